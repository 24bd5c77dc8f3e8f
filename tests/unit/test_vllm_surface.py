"""The rebuilt `vllm serve` surface accepts and refuses what vLLM 0.33.0 does."""

from __future__ import annotations

import pytest

from fleet.plan.vllm_surface import SurfaceError, accepted_flags, human_readable_int, parse_serve_argv


@pytest.mark.parametrize(
    "argv",
    [
        ["m", "--swap-space", "4"],
        ["m", "--num-scheduler-steps", "8"],
        ["m", "--speculative-model", "draft"],
        ["m", "--preemption-mode", "swap"],
        ["m", "--gpu-mem", "0.9"],  # abbreviations: we emit full names only
        ["m", "--tensor-parallel-size", "two"],
    ],
)
def test_removed_unknown_or_malformed_flags_are_refused(argv: list[str]) -> None:
    with pytest.raises(SurfaceError):
        parse_serve_argv(argv)


def test_removed_flag_message_is_argparse_unrecognized() -> None:
    with pytest.raises(SurfaceError, match="unrecognized arguments: --swap-space 4"):
        parse_serve_argv(["m", "--swap-space", "4"])


def test_enable_disable_spellings_of_0_33() -> None:
    on = parse_serve_argv(["m", "--enable-prefix-caching"])
    off = parse_serve_argv(["m", "--disable-prefix-caching", "--no-enable-chunked-prefill"])
    assert on.enable_prefix_caching is True
    assert (off.enable_prefix_caching, off.enable_chunked_prefill) == (False, False)
    assert parse_serve_argv(["m", "--disable-log-requests"]).enable_log_requests is False  # 0.33 re-accepts it


def test_underscores_equal_dashes_and_values_parse() -> None:
    ns = parse_serve_argv(["m", "--max_model_len", "4096", "--gpu-memory-utilization", "0.9", "-tp", "2"])
    assert (ns.model_tag, ns.max_model_len, ns.gpu_memory_utilization, ns.tensor_parallel_size) == ("m", 4096, 0.9, 2)


@pytest.mark.parametrize("text, value", [("1k", 1000), ("1K", 1024), ("2G", 2 * 1024**3), ("4096", 4096)])
def test_human_readable_ints(text: str, value: int) -> None:
    assert human_readable_int(text) == value


def test_surface_has_the_flags_the_planner_uses() -> None:
    flags = accepted_flags()
    for flag in ("--shutdown-timeout", "--max-model-len", "--kv-cache-dtype", "--no-enable-prefix-caching", "--host"):
        assert flag in flags
    assert "--swap-space" not in flags
