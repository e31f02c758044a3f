"""`specsuite bench` on the real small model: the report's figures and the app's prefix cache."""

import pytest

from specsuite import bench

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
    monkeypatch.setattr(bench, "load_model", lambda name, dtype=None, backend="auto": smollm2_fp32)
    report = bench.run_bench("gec", "smollm2-135m", jfleg, n=3, max_new_tokens=12, methods=["spec_copy"],
                             prefix_cache=prefix_cache)
    assert report["n"] == 3 and report["spec_prefix_cache"] is prefix_cache
    assert report["backend"] == "fp32-cpu"  # the backend our methods ran is in the report
    assert set(report["methods"]) == {"hf_greedy", "spec_copy"}
    ours = report["methods"]["spec_copy"]
    assert ours["identical_to_greedy"] == 1.0 and report["mismatches"]["spec_copy"] == []
    assert ours["new_tokens"] == report["methods"]["hf_greedy"]["new_tokens"] > 0
    assert 0 < ours["forwards_per_token"] <= 1.0 and ours["total_s"] > 0
    assert "spec_copy" in bench.format_table(report)
    assert "forward" not in vars(smollm2_fp32[0])  # the forward counter is gone with the run
