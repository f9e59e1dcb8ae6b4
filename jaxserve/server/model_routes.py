"""The model's own routes of the OpenAI HTTP API (``http.OpenAIServer``
takes them): ``GET /v1/models`` and ``/v1/models/{id}`` (the model and its LoRA
adapters as vLLM's cards), and vLLM's ``POST /tokenize`` and ``/detokenize``
through the front end's tokenizer pool."""

from __future__ import annotations

from fastapi import Request

from jaxserve.server import openai_protocol as oai
from jaxserve.server.chat_tools import chat_pairs
from jaxserve.server.frontend import chat_messages
from jaxserve.server.tool_parsers import plan_tools


class ModelRoutes:
    """The model's routes; the server provides ``_auth``, ``_ready``, ``_body``,
    ``_errors``, ``frontend`` and ``created`` (the cards' Unix time)."""

    async def models(self, request: Request):
        """``GET /v1/models``: the served model, then its LoRA adapters (vLLM's
        cards: ``root`` the adapter's folder, ``parent`` the model)."""
        self._auth(request)
        engine = self._ready()
        base = self.frontend.model_name
        cards = [oai.model_card(base, self.created, engine.max_model_len)]
        cards += [oai.model_card(name, self.created, engine.max_model_len, root=path,
                                 parent=base)
                  for name, path in sorted(engine.lora_adapters().items())]
        return {"object": "list", "data": cards}

    async def model(self, request: Request, model_id: str):
        """``GET /v1/models/{id}``: the served model or an adapter's card, or
        404 for another id."""
        listing = await self.models(request)
        for card in listing["data"]:
            if card["id"] == model_id:
                return card
        with self._errors():
            self.frontend.resolve_model(model_id)  # raises: 404 naming model
        raise oai.APIError(404, f"The model `{model_id}` does not exist", "model")

    async def tokenize(self, request: Request):
        """vLLM's ``/tokenize``: ``{prompt, add_special_tokens (default true)}``
        or ``{messages, tools (optional)}`` -> ``{tokens, count, max_model_len}``."""
        self._auth(request)
        engine = self._ready()
        body = await self._body(request)
        if not isinstance(body, dict) or ("prompt" in body) == ("messages" in body):
            raise oai.bad_request("the body needs exactly one of 'prompt' or 'messages'")
        with self._errors():
            if "prompt" in body:
                prompt = body["prompt"]
                special = body.get("add_special_tokens", True)
                if not isinstance(prompt, str) or not isinstance(special, bool):
                    raise oai.bad_request("prompt: must be a string (add_special_tokens a bool)",
                                          "prompt")
                ids = await self.frontend.text_ids(prompt, "prompt", special)
            else:
                req = oai.parse(oai.ChatCompletionRequest, {"messages": body["messages"],
                                                            "tools": body.get("tools")})
                plan = plan_tools(req.tools, None, None)
                ids = await self.frontend.chat_ids(chat_messages(chat_pairs(req), "messages"),
                                                   "messages", plan.tools if plan else None)
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len}

    async def detokenize(self, request: Request):
        """vLLM's ``/detokenize``: ``{tokens}`` -> ``{prompt}``."""
        self._auth(request)
        self._ready()
        body = await self._body(request)
        tokens = body.get("tokens") if isinstance(body, dict) else None
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise oai.bad_request("tokens: must be a list of token ids", "tokens")
        with self._errors():
            return {"prompt": self.frontend.detokenize(tokens, "tokens",
                                                       skip_special_tokens=False)}
