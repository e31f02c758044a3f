"""`specsuite bench` on the real small model: the report's figures and the app's prefix cache."""

import pytest

from specsuite.bench import cli as bench
from specsuite.core.model.backend import choose_backend
from specsuite.core.kernels.int8_linear import int8_pays, int8_runs

pytestmark = pytest.mark.real_model


@pytest.fixture()
def jfleg(shared_data):
    path = shared_data / "jfleg/dev.src"
    if not path.exists():
        pytest.skip(f"no JFLEG data at {path}")
    return path


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_gec_bench_compares_the_copy_drafter_with_hf_greedy(smollm2_fp32, jfleg, monkeypatch, prefix_cache):
    """Every method's output is compared with HF greedy token for token; in fp32 our methods reuse
    the shared instruction's KV as the app does, unless turned off."""
    monkeypatch.setattr(bench, "load_model", lambda name, dtype=None, adapter=None, task=None: smollm2_fp32)
    report = bench.run_bench("gec", "smollm2-135m", jfleg, n=3, max_new_tokens=12, methods=["spec_copy"],
                             prefix_cache=prefix_cache, backend="auto")
    assert report["n"] == 3 and report["spec_prefix_cache"] is prefix_cache
    # the backend our methods ran is in the report (the logit screen where this CPU measured it to pay)
    assert report["backend"] == choose_backend(smollm2_fp32[0]).label and report["backend"].startswith("fp32-cpu")
    assert set(report["methods"]) == {"hf_greedy", "spec_copy"}
    ours = report["methods"]["spec_copy"]
    assert ours["identical_to_greedy"] == 1.0 and report["mismatches"]["spec_copy"] == []
    assert ours["new_tokens"] == report["methods"]["hf_greedy"]["new_tokens"] > 0
    assert 0 < ours["forwards_per_token"] <= 1.0 and ours["total_s"] > 0
    assert "spec_copy" in bench.format_table(report)
    assert "forward" not in vars(smollm2_fp32[0]) and not smollm2_fp32[0]._forward_pre_hooks  # the counter is gone


def test_jobs_bench_alternates_rounds_and_compares_with_the_best_hf_batch(smollm2_fp32, jfleg, monkeypatch):
    """`bench gec-batch`: every method but the reference runs once per round (in a rotated order),
    its time is the mean of its rounds, and the speedups are against the best HF batch size."""
    from specsuite.bench import batch as bench_batch

    monkeypatch.setattr(bench_batch, "load_model", lambda name, dtype=None, adapter=None, task=None: smollm2_fp32)
    refs = [jfleg.with_name("dev.ref0")] if jfleg.with_name("dev.ref0").exists() else []
    report = bench_batch.run_gec_batch("smollm2-135m", jfleg, n=5, batch_sizes=[2], max_new_tokens=12,
                                       refs=refs, methods=["hf_greedy_bs2", "spec_batch", "gec_job"], rounds=2)
    methods = report["methods"]
    assert report["rounds"] == 2 and set(methods) == {"hf_greedy_bs1", "hf_greedy_bs2", "spec_batch", "gec_job"}
    assert len(methods["hf_greedy_bs1"]["round_s"]) == 1  # the reference runs once
    for name in ("hf_greedy_bs2", "spec_batch", "gec_job"):
        f = methods[name]
        assert len(f["round_s"]) == 2 and f["total_s"] == pytest.approx(sum(f["round_s"]) / 2, abs=2e-3)
        assert f["speedup_vs_best_hf_batch"] == pytest.approx(
            f["sentences_per_s"] / methods["hf_greedy_bs2"]["sentences_per_s"], rel=1e-2)
        assert 0.0 <= f["identical_to_greedy"] <= 1.0 and f["new_tokens"] > 0
        assert ("gleu" in f) == bool(refs)
    assert methods["hf_greedy_bs1"]["identical_to_greedy"] == 1.0
    with pytest.raises(ValueError, match="rounds"):
        bench_batch.run_gec_batch("smollm2-135m", jfleg, n=5, batch_sizes=[2], rounds=0)


def test_rag_serve_bench_alternates_rounds_of_both_apps(smollm2_fp32, shared_data, monkeypatch):
    """`bench rag-serve`: both apps serve at once, each of the four runs (app x sequential or
    concurrent) once per round, figures the mean of their rounds; the answers equal one at a time's."""
    from specsuite.bench import serve as bench_serve

    data = shared_data / "specbench/rag_dev.jsonl"
    if not data.exists():
        pytest.skip(f"no Spec-Bench RAG data at {data}")
    monkeypatch.setattr(bench_serve, "load_model", lambda name, dtype=None, adapter=None, task=None: smollm2_fp32)
    report = bench_serve.run_rag_serve("smollm2-135m", data, n=2, max_new_tokens=8, rounds=2)
    assert report["rounds"] == 2 and set(report["apps"]) == {"one_at_a_time", "batched"}
    for f in report["apps"].values():
        for mode in ("sequential", "concurrent"):
            assert len(f["round_s"][mode]) == 2
            assert f[f"{mode}_s"] == pytest.approx(sum(f["round_s"][mode]) / 2, abs=2e-3)
        assert f["new_tokens"] > 0
    assert report["batched_concurrent_vs_sequential"] == pytest.approx(
        report["apps"]["one_at_a_time"]["sequential_s"] / report["apps"]["batched"]["concurrent_s"], rel=1e-2)
    assert set(report["identical_to_one_at_a_time"].values()) == {1.0}  # fp32: the batch answers as one at a time
    assert "concurrent" in bench_serve.format_serve(report)
    with pytest.raises(ValueError, match="rounds"):
        bench_serve.run_rag_serve("smollm2-135m", data, rounds=0)


def test_bench_command_refuses_bad_counts_before_loading_anything(jfleg, capsys):
    from specsuite.cli import main

    for flag in ("--rounds", "--n"):
        with pytest.raises(SystemExit) as exit_:
            main(["bench", "gec-batch", "--data", str(jfleg), flag, "0"])
        assert exit_.value.code == 2 and "expected a positive integer, got '0'" in capsys.readouterr().err


def test_peers_bench_runs_our_engine_and_names_the_peers_it_lacks(smollm2_fp32, jfleg, monkeypatch, tmp_path):
    """`bench peers` without installed peers: our one-at-a-time and batched runs on the same
    prompt ids, each compared token for token with the one-at-a-time (greedy) outputs; the
    missing peers are named with the command that sets them up."""
    from specsuite import models
    from specsuite.bench import peers as bench_peers

    monkeypatch.setattr(models, "load_model", lambda name, dtype=None, adapter=None, task=None: smollm2_fp32)
    monkeypatch.setattr(bench_peers, "ANCHORS_CACHE", tmp_path / "no-anchors")
    report = bench_peers.run_peers("smollm2-135m", jfleg, n=4, max_new_tokens=12, parallel=[1, 2],
                                   anchors=tmp_path / "anchors", rounds=2)
    assert len(report["rounds"]) == 2 and report["n"] == 4
    for configs in report["rounds"]:
        assert set(configs) == {"specsuite_one", "specsuite_batch2"}
        assert configs["specsuite_one"]["identical_to_reference"] == 4  # the reference itself
        assert 0 <= configs["specsuite_batch2"]["identical_to_reference"] <= 4
        assert all(f["sent_per_s"] > 0 and f["new_tokens"] > 0 for f in configs.values())
    assert [c["specsuite_one"]["new_tokens"] for c in report["rounds"]] == [report["rounds"][0]["specsuite_one"]["new_tokens"]] * 2
    assert set(report["missing"]) == {"llama-server", "OpenVINO GenAI"}
    table = bench_peers.format_peers(report)
    assert "round 2 of 2" in table and "specsuite_batch2" in table and "not installed: llama-server: bash" in table


@pytest.mark.skipif(not (int8_pays() and int8_runs()), reason="oneDNN's int8 kernel is slow or inexact on this CPU")
def test_peers_bench_runs_our_engine_on_the_backend_asked(smollm2_fp32, jfleg, monkeypatch, tmp_path):
    """--backend int8: our runs in int8, the reference (every row's comparison) int8 greedy."""
    from specsuite import models
    from specsuite.bench import peers as bench_peers

    monkeypatch.setattr(models, "load_model", lambda name, dtype=None, adapter=None, task=None: smollm2_fp32)
    monkeypatch.setattr(bench_peers, "ANCHORS_CACHE", tmp_path / "no-anchors")
    report = bench_peers.run_peers("smollm2-135m", jfleg, n=3, max_new_tokens=8, parallel=[1, 2],
                                   anchors=tmp_path / "anchors", backend="int8")
    assert report["reference_backend"] == "int8"
    assert report["rounds"][0]["specsuite_one"]["identical_to_reference"] == 3
    assert "(int8 backend)" in bench_peers.format_peers(report)


def test_peers_deciding_only_runs_each_peers_speculation_alone_and_its_plain_batches():
    """--deciding-only: one at a time, only the peers' speculation (their fastest there); in
    batches, only their plain pipelines; without it, every configuration in one call per peer."""
    from specsuite.bench.peers import _peer_calls

    assert _peer_calls([1, 32, 64], deciding_only=True) == [
        (["--parallel", "1", "--spec", "ngram-simple", "--no-baseline"], ["--batch", "1", "--prompt-lookup", "--no-baseline"]),
        (["--parallel", "32,64"], ["--batch", "32,64"])]
    assert _peer_calls([64], deciding_only=True) == [(["--parallel", "64"], ["--batch", "64"])]
    assert _peer_calls([1, 64], deciding_only=False) == [
        (["--parallel", "1,64", "--spec", "ngram-simple"], ["--batch", "1,64", "--prompt-lookup"])]
