"""Issue 34's client acceptance on SmolLM2-135M against a real server on 127.0.0.1: openai parse / json_object / regex / choice / EBNF / forced and auto tool calls / stream reassembly / a tool reply / LangChain / instructor. Prints a JSON summary (run: python benchmarks/structured/client_acceptance.py)."""
import json, re, sys, time
sys.path.insert(0, __import__("os").path.join(__import__("os").path.dirname(__file__), "..", "..", "tests"))
from typing import Literal, Optional
import jsonschema, openai
from pydantic import BaseModel, Field
from server_util import ServerProcess

class Address(BaseModel):
    city: str = Field(max_length=20)
    zip: str = Field(pattern=r"^[0-9]{5}$")

class Person(BaseModel):
    name: str = Field(max_length=20)
    age: int = Field(ge=0, le=120)
    role: Literal["admin", "user"]
    tags: list[Literal["a", "b", "c"]] = Field(min_length=1, max_length=3)
    address: Address
    nickname: Optional[str] = Field(default=None, max_length=10)

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
    "unit": {"type": "string", "enum": ["C", "F"]}}, "required": ["city"]}}}
ADD = {"type": "function", "function": {"name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"]}}}
res = {}
s = ServerProcess(["--model", "smollm2-135m", "--http_port", "0"], timeout_s=600)
try:
    c = openai.OpenAI(base_url=s.http_url + "/v1", api_key="x")
    M = "smollm2-135m"
    msg = [{"role": "user", "content": "Invent a person and give their details as JSON."}]
    schema = Person.model_json_schema()
    ok = stop = 0; t0 = time.time()
    for seed in range(20):
        r = c.chat.completions.parse(model=M, messages=msg, response_format=Person, temperature=1.0,
                                     seed=seed, max_tokens=300)
        m = r.choices[0].message
        if r.choices[0].finish_reason == "stop":
            stop += 1
            jsonschema.validate(json.loads(m.content), schema); assert isinstance(m.parsed, Person)
            ok += 1
    res["parse_pydantic"] = f"{ok}/20 valid, {stop}/20 stopped ({time.time()-t0:.0f} s)"
    jo = 0
    for seed in range(10):
        r = c.chat.completions.create(model=M, messages=msg, response_format={"type": "json_object"},
                                      temperature=1.0, seed=seed, max_tokens=200)
        if r.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(r.choices[0].message.content), dict); jo += 1
    res["json_object"] = f"{jo}/10 parsed (others cut by max_tokens: {10-jo})"
    kw = dict(model=M, messages=[{"role": "user", "content": "Give me a phone number and a date."}],
              temperature=1.0, max_tokens=40)
    n = 0
    for seed in range(5):
        for rx in (r"\(\d{3}\) \d{3}-\d{4}", r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"):
            out = c.chat.completions.create(extra_body={"guided_regex": rx}, seed=seed, **kw).choices[0].message.content
            assert re.fullmatch(rx, out), (rx, out); n += 1
        out = c.chat.completions.create(extra_body={"guided_choice": ["yes", "no", "maybe"]}, seed=seed, **kw).choices[0].message.content
        assert out in ("yes", "no", "maybe"); n += 1
        g = 'root ::= "(" digit "+" digit ")"\ndigit ::= [0-9]'
        out = c.chat.completions.create(extra_body={"guided_grammar": g}, seed=seed, **kw).choices[0].message.content
        assert re.fullmatch(r"\(\d\+\d\)", out), out; n += 1
    res["regex_choice_grammar"] = f"{n}/20 matched"
    tmsg = [{"role": "user", "content": "What is the weather in Paris?"}]
    params = {"get_weather": WEATHER["function"]["parameters"], "add": ADD["function"]["parameters"]}
    calls = 0
    for seed in range(5):
        for tc in ("required", {"type": "function", "function": {"name": "get_weather"}}):
            r = c.chat.completions.create(model=M, messages=tmsg, tools=[WEATHER, ADD], tool_choice=tc,
                                          temperature=1.0, seed=seed, max_tokens=120)
            ch = r.choices[0]
            if ch.finish_reason == "length":
                res.setdefault("forced_cut_by_length", []).append(ch.message.content[:120]); continue
            assert ch.finish_reason == "tool_calls", ch
            for call in ch.message.tool_calls:
                jsonschema.validate(json.loads(call.function.arguments), params[call.function.name])
                if isinstance(tc, dict): assert call.function.name == "get_weather"
            calls += 1
    res["forced_tool_calls"] = f"{calls}/10 valid calls"
    auto = [c.chat.completions.create(model=M, messages=tmsg, tools=[WEATHER, ADD], temperature=0.7, seed=sd,
                                      max_tokens=80).choices[0] for sd in range(3)]
    res["auto"] = [("calls" if a.message.tool_calls else "content", a.finish_reason) for a in auto]
    # stream reassembly
    st = c.chat.completions.create(model=M, messages=tmsg, tools=[WEATHER], tool_choice="required", seed=1,
                                   temperature=1.0, max_tokens=120, stream=True)
    name, args, fin = None, "", None
    for ch in st:
        if not ch.choices: continue
        d = ch.choices[0].delta
        for tcd in d.tool_calls or []:
            name = tcd.function.name or name; args += tcd.function.arguments or ""
        fin = ch.choices[0].finish_reason or fin
    whole = c.chat.completions.create(model=M, messages=tmsg, tools=[WEATHER], tool_choice="required", seed=1,
                                      temperature=1.0, max_tokens=120).choices[0].message.tool_calls[0]
    res["stream_reassembly"] = str((name, args[:80], fin, whole.function.name, whole.function.arguments[:80]))
    first = c.chat.completions.create(model=M, messages=tmsg, tools=[WEATHER], tool_choice="required", seed=2,
                                      max_tokens=120)
    call = (first.choices[0].message.tool_calls or [None])[0]
    if call is None:
        raise SystemExit(json.dumps(res, indent=1, default=str))
    follow = tmsg + [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21C"}]
    r = c.chat.completions.create(model=M, messages=follow, tools=[WEATHER], max_tokens=40, temperature=0)
    res["tool_reply_continues"] = repr((r.choices[0].message.content or "")[:80])
    from langchain_openai import ChatOpenAI
    class City(BaseModel):
        city: str = Field(max_length=20)
        country: str = Field(max_length=20)
    llm = ChatOpenAI(base_url=s.http_url + "/v1", api_key="x", model=M, temperature=0, max_tokens=100)
    for method in ("json_schema", "function_calling"):
        out = llm.with_structured_output(City, method=method).invoke("Name a city and its country.")
        assert isinstance(out, City); res[f"langchain_{method}"] = out.model_dump()
    ai = llm.bind_tools([WEATHER], tool_choice="required").invoke("Weather in Oslo?")
    res["langchain_bind_tools"] = ai.tool_calls
    import instructor
    for mode in (instructor.Mode.JSON, instructor.Mode.TOOLS):
        ic = instructor.from_openai(openai.OpenAI(base_url=s.http_url + "/v1", api_key="x"), mode=mode)
        try:
            out = ic.chat.completions.create(model=M, response_model=City, max_tokens=300, temperature=0,
                                             messages=[{"role": "user", "content": "Name a city and its country."}])
            res[f"instructor_{mode.name}"] = out.model_dump()
        except Exception as e:
            res[f"instructor_{mode.name}"] = f"FAILED: {type(e).__name__}: {str(e)[:200]}"
finally:
    s.terminate()
print(json.dumps(res, indent=1, default=str))
