"""The issue-16 writer benchmark (``python -m jaxserve.bench.writer``): its
``--smoke`` run writes the JSON with every sweep point and its roofline, the
workloads' figures and the targets, the report and the plot; the smoothness
flag and the memory cap are checked on made-up numbers."""

import json

PNG = b"\x89PNG\r\n\x1a\n"


def test_writer_smoke(tmp_path, capsys):
    from jaxserve.bench import writer
    out = tmp_path / "w"
    assert writer.main(["--smoke", "--output", str(out)]) == 0
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
    assert md.startswith(f"# jaxserve writer benchmark (issue 16) on {r['machine']['cpu_model']}")
    assert "## Decode sweep" in md and "## W1 and W2" in md and "## Issue 16 targets" in md
    assert (out / "sweep.png").read_bytes()[:8] == PNG
    assert "## W1 and W2" in capsys.readouterr().out


def test_smoothness_flag_and_memory_cap(monkeypatch):
    from jaxserve.bench import writer
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
    monkeypatch.setattr(writer, "_mem_available", lambda: writer.MEMORY_RESERVE + 20 * per_page)
    want, got, why = writer.sweep_pages(SMOKE, [4], [64], 16)
    assert (want, got, why) == (16, 16, None)
    want, got, why = writer.sweep_pages(SMOKE, [64], [4096], 16)
    assert want == 64 * 256 and got == 20 and "capped at 20 pages" in why


def test_writer_hf_peer_on_a_tiny_folder(tmp_path, tiny_hf):
    """``run_peer("hf")``: W1 as one static batch and W2, exactly each
    request's output length, agreement with the reference records."""
    from jaxserve.bench import writer
    from jaxserve.bench.workloads import BenchRequest
    tiny_hf.save_pretrained(tmp_path / "hf")
    w1 = [BenchRequest("chat", [5 + i, 7, 9, 11 + i], 4) for i in range(3)]
    w2 = BenchRequest("rag", list(range(3, 30)), 5)
    e = writer.run_peer("hf", str(tmp_path / "hf"), w1, w2, {}, 0.0)
    assert "skipped" not in e, e
    assert e["w1"]["requests"] == 3 and e["w1"]["output_tokens_each"] == [4]
    assert e["w1"]["output_tok_per_s"] > 0 and e["w1"]["token_agreement"] is None
    assert e["w2"]["output_tokens"] == 5 and e["w2"]["ttft_ms"] > 0 and e["w2"]["tpot_ms"] > 0
