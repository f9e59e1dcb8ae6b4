"""The decode benchmark (``python -m jaxserve.bench throughput --sweep``): its
``--smoke`` run writes the JSON with every sweep point and its roofline, the
workloads' figures and the targets, the report and the plot; the smoothness
flag and the memory cap are checked on made-up numbers; ``--formats`` /
``--kv_cache_dtypes`` run W1/W2 once per pair with weight bytes, KV pages at
one budget, MBU and the format targets."""

import json

PNG = b"\x89PNG\r\n\x1a\n"


def test_writer_smoke(tmp_path, capsys):
    from jaxserve.bench.__main__ import main
    out = tmp_path / "w"
    assert main(["throughput", "--sweep", "--smoke", "--output", str(out)]) == 0
    r = json.loads((out / "result.json").read_text())
    assert r["smoke"] and r["machine"]["cpu_count"] >= 1 and r["machine"]["jax"]
    assert r["limits"]["matmul_flops_per_s"] > 0 and r["limits"]["matvec_bytes_per_s"] > 0
    pts = r["sweep"]["points"]
    assert [(p["ctx"], p["rows"]) for p in pts] == [(c, n) for c in (16, 40) for n in (1, 2, 4)]
    for p in pts:
        assert p["step_ms"] > 0 and p["tokens_per_s"] > 0 and p["compilations_timed"] == 0
        assert p["roofline_ms"] == p["weights_ms"] + p["attention_ms"] > 0
    assert pts[1]["smooth_ratio"] > 0 and pts[0]["smooth_ratio"] is None
    js = r["workloads"]["engines"]["jaxserve"]
    assert js["w1"]["output_tokens_each"] == [8] and js["w1"]["output_tok_per_s"] > 0
    assert js["w2"]["output_tokens"] == 8 and js["w2"]["ttft_ms"] > 0 and js["w2"]["tpot_ms"] > 0
    assert js["w1"]["compilations"] == js["w2"]["compilations"] == 0
    assert r["workloads"]["prompts"]["w2"]["prompt_tokens"] == 40
    assert {t["target"]: t["met"] for t in r["targets"]}["XLA compilations in timed passes"]
    md = (out / "report.md").read_text()
    assert md.startswith(f"# jaxserve decode benchmark on {r['machine']['cpu_model']}")
    assert "## Decode sweep" in md and "## W1 and W2" in md and "## Targets" in md
    assert (out / "sweep.png").read_bytes()[:8] == PNG
    assert "## W1 and W2" in capsys.readouterr().out


def test_writer_smoke_formats(tmp_path, capsys):
    """Every (format, KV dtype) pair once, warmed up, 0 compilations timed;
    int8 weights and KV shrink what the issue says they shrink."""
    from jaxserve.bench.__main__ import main
    out = tmp_path / "q"
    assert main(["throughput", "--smoke", "--formats", "none,int8", "--kv_cache_dtypes",
                 "auto,int8", "--output", str(out)]) == 0
    r = json.loads((out / "result.json").read_text())
    fm = r["quant"]["formats"]
    assert [(e["quantization"], e["kv_cache_dtype"]) for e in fm] == [
        ("none", "auto"), ("none", "int8"), ("int8", "auto"), ("int8", "int8")]
    base = fm[0]
    assert base["w1"] == r["workloads"]["engines"]["jaxserve"]["w1"]  # f32 run once
    for e in fm:
        assert e["w1"]["output_tokens_each"] == [8] and e["w1"]["output_tok_per_s"] > 0
        assert e["w2"]["tpot_ms"] > 0 and e["w1"]["compilations"] == e["w2"]["compilations"] == 0
        assert e["warmup"]["compilations"] >= 0 and 0 < e["mbu"]
        assert e["decode_bytes_per_step"] == e["weight_bytes"]["total"] + e[
            "kv_bytes_per_token"] * (40 + 8 / 2)
        assert e["vs"]["f32"]["w2_tpot"] > 0 and e["kv_cache_mib"] == 1
    int8 = fm[2]
    # Projections: int8 values + one f32 scale per output row, vs f32 values.
    assert 0.25 < int8["weight_bytes_vs_f32"]["projections"] < 0.27
    assert int8["weight_bytes_vs_f32"]["total"] < 1
    assert fm[1]["kv_pages"] > 3 * base["kv_pages"] and fm[1]["kv_bytes_per_token"] < \
        base["kv_bytes_per_token"] / 3  # int8 with f32 scales: 160 of 512 bytes at H = 16
    got = {t["target"]: t for t in r["quant"]["targets"]}
    assert got["W2 TPOT int8 (KV int8) / llama.cpp's"]["met"] is None  # no peers in smoke
    assert got["weight bytes int8 / f32, projections"]["met"] is True
    md = (out / "report.md").read_text()
    assert "## Weight formats and KV cache dtypes" in md and "## Weight format targets" in md
    assert "| int8 | int8 |" in md and "| none | auto |" in md
    # The CPU kernel's column limits this run served with: the suite keeps the built-in
    # table (conftest), and the report names them.
    from pallas_kernels.quant_matmul_cpu import BUILTIN_MAX_COLUMNS
    widths = r["kernel_widths"]
    assert widths["int8"] == {"max_columns": BUILTIN_MAX_COLUMNS["int8"], "source": "builtin",
                              "wide_form": "int8_dot"}
    assert widths["f32"]["wide_form"] is None and widths["f32"]["source"] == "builtin"
    assert f"int8 {BUILTIN_MAX_COLUMNS['int8']} (then XLA: int8_dot) [builtin]" in md
    assert "## Weight format targets" in capsys.readouterr().out


def test_quant_formats_parse_and_targets():
    import pytest

    from jaxserve.bench import formats as quant_bench
    assert quant_bench.parse_formats("int8,none", "int8") == [
        ("none", "auto"), ("int8", "int8"), ("none", "int8")]
    assert quant_bench.parse_formats("int8,w8a8:int8", "auto") == [
        ("none", "auto"), ("int8", "auto"), ("w8a8", "int8")]
    for bad in ("int3", "", "int8,int8", "w8a8:int3", "int8,int8:auto"):
        with pytest.raises(ValueError, match="--formats"):
            quant_bench.parse_formats(bad, "auto")
    with pytest.raises(ValueError, match="--kv_cache_dtypes"):
        quant_bench.parse_formats("none", "int4")
    run = lambda q, kv, tps, tpot, wb: {"quantization": q, "kv_cache_dtype": kv,
                                        "w1": {"output_tok_per_s": tps},
                                        "w2": {"tpot_ms": tpot},
                                        "weight_bytes_vs_f32": {"total": wb, "projections": wb}}
    formats = [run("none", "auto", 100.0, 40.0, 1.0), run("w8a8", "auto", 160.0, 10.0, 0.4),
               run("int4", "auto", 90.0, 9.0, 0.15)]
    got = {t["target"]: t for t in quant_bench.targets(formats, {"w2": {"tpot_ms": 10.0}})}
    assert got["W2 TPOT w8a8 (KV auto) / llama.cpp's"]["met"] is True  # 1.0 <= 1.0
    assert got["W2 TPOT int4 (KV auto) / llama.cpp's"]["met"] is False  # 0.9 > 0.8
    assert got["W1 out tok/s w8a8 (KV auto) / f32 (KV auto)"]["value"] == 1.6
    assert got["weight bytes int4 / f32, whole model"]["met"] is True
    assert "weight bytes w8a8 / f32, whole model" not in got


def test_smoothness_flag_and_memory_cap(monkeypatch):
    from jaxserve.bench import decode_sweep as writer
    from jaxserve.bench.device import SMOKE
    pts = [{"ctx": 8, "rows": n, "step_ms": t} for n, t in ((1, 10.0), (2, 20.0), (4, 20.0),
                                                            (8, 40.0))]
    pts.append({"ctx": 8, "rows": 16, "skipped": "no pages"})
    writer.flag_smoothness(pts)
    # rows 2: line 1 -> 4 at 2 is 13.3, 20 / 13.3 = 1.5 (flagged); rows 4: line 2 -> 8 is 26.7
    assert pts[1]["smooth_flag"] and abs(pts[1]["smooth_ratio"] - 1.5) < 1e-9
    assert not pts[2]["smooth_flag"] and pts[3]["smooth_ratio"] is None
    assert "smooth_ratio" not in pts[4]
    per_page = writer.kv_bytes_per_token(SMOKE) * 16
    monkeypatch.setattr(writer, "mem_available", lambda: writer.MEMORY_RESERVE + 20 * per_page)
    want, got, why = writer.sweep_pages(SMOKE, [4], [64], 16)
    assert (want, got, why) == (16, 16, None)
    want, got, why = writer.sweep_pages(SMOKE, [64], [4096], 16)
    assert want == 64 * 256 and got == 20 and "capped at 20 pages" in why


def test_writer_hf_peer_on_a_tiny_folder(tmp_path, tiny_hf):
    """``run_peer("hf")``: W1 as one static batch and W2, exactly each
    request's output length, agreement with the reference records."""
    from jaxserve.bench import comparison as writer
    from jaxserve.bench.workloads import BenchRequest
    tiny_hf.save_pretrained(tmp_path / "hf")
    w1 = [BenchRequest("chat", [5 + i, 7, 9, 11 + i], 4) for i in range(3)]
    w2 = BenchRequest("rag", list(range(3, 30)), 5)
    e = writer.run_peer("hf", str(tmp_path / "hf"), w1, w2, {}, 0.0)
    assert "skipped" not in e, e
    assert e["w1"]["requests"] == 3 and e["w1"]["output_tokens_each"] == [4]
    assert e["w1"]["output_tok_per_s"] > 0 and e["w1"]["token_agreement"] is None
    assert e["w2"]["output_tokens"] == 5 and e["w2"]["ttft_ms"] > 0 and e["w2"]["tpot_ms"] > 0


def test_gguf_format_takes_the_files_blocks(tiny_gguf):
    """``GgufParams("gguf")`` loads the GGUF again with its blocks kept, so the
    run's ``gguf`` engine holds the file's Q8_0 (int8 + an f32 scale per 32
    inputs: 1.125 of f32's 4 bytes per projection weight); other formats get
    the float params."""
    from checkpoints.loader import load_checkpoint
    from conftest import XLA_CACHE
    from jaxserve import LLM
    from jaxserve.bench import formats as quant_bench
    ck = load_checkpoint(tiny_gguf, show_progress=False)
    parts = quant_bench.GgufParams({"model_config": ck.config, "params": ck.params,
                                    "tokenizer": ck.tokenizer}, tiny_gguf, smoke=False)
    assert parts("int8")["params"] is ck.params
    kw = {"num_pages": 16, "max_num_seqs": 2, "max_model_len": 64, "max_num_batched_tokens": 16,
          "compilation_cache_dir": XLA_CACHE}
    wb = {q: quant_bench.weight_bytes(LLM(tiny_gguf, **parts(q), quantization=q, **kw).engine)
          for q in ("none", "gguf")}
    # Q8_0 blocks: one int8 per weight + one f16 scale per 32
    assert wb["gguf"]["projections"] / wb["none"]["projections"] == (1 + 2 / 32) / 4
    assert wb["gguf"]["total"] < wb["none"]["total"]
