"""``serving_preset``: throughput, latency and long-context profiles as ``--max-num-batched-tokens``
and ``--max-num-seqs``, derived from the workload and the KV budget instead of vLLM's defaults.

vLLM 0.33 picks both by GPU size alone (``EngineArgs.get_batch_defaults``, ``vllm/engine/arg_utils.py``;
``fleet.plan.planner.batch_defaults``): 8192 tokens and 1024 sequences on an H100, 2048 and 256 on
an A100 or L40S. What each knob trades, from vLLM's "Optimization and Tuning" page (chunked
prefill): a smaller ``max_num_batched_tokens`` (e.g. 2048) gives a better inter-token latency, since
fewer prefill tokens slow down each decode step; a larger one a better time to first token and,
above 8192, a better throughput; ``max_num_seqs`` bounds the requests batched at once, and requests
admitted beyond what the KV cache holds are preempted (recomputed: V1 preempts by recompute),
which costs more than queueing them.

The profiles (pure functions, table-tested):

* ``throughput``: twice vLLM's default batched tokens, as vLLM's own ``--performance-mode
  throughput`` does (``_set_default_max_num_seqs_and_batched_tokens_args``), and as many sequences
  as the KV cache holds requests of the workload (no more: they would be preempted);
* ``latency``: 2048 batched tokens (the docs' value for inter-token latency), and only the
  workload's target concurrency (or what the KV cache holds, if less): a smaller batch per step;
* ``long_context``: batched tokens to prefill the workload's p95 input in one step (up to 32768,
  never below the default), and as many sequences as the KV cache holds such requests.

vLLM's own constraints hold for every result (``SchedulerConfig``, ``vllm/config/scheduler.py``):
``max_num_batched_tokens >= max_num_seqs`` (it refuses otherwise) and at most ``max_num_seqs ×
max_model_len`` (it warns).
"""

from __future__ import annotations

from dataclasses import dataclass

PRESETS: tuple[str, ...] = ("throughput", "latency", "long_context")
#: vLLM's "Optimization and Tuning": "smaller values (e.g., 2048) achieve better inter-token latency".
LATENCY_BATCHED_TOKENS = 2048
#: The most batched tokens a long-context preset asks for: the activation peak of vLLM's profiling
#: run grows with it, and with it the memory taken from the KV cache.
LONG_CONTEXT_MAX_BATCHED_TOKENS = 32768
CHUNK = 1024  #: batched tokens are rounded up to this


@dataclass(frozen=True)
class Batch:
    """``--max-num-batched-tokens`` and ``--max-num-seqs`` of a preset, each with its reason."""

    preset: str
    max_num_batched_tokens: int
    max_num_seqs: int
    tokens_reason: str
    seqs_reason: str

    @property
    def pair(self) -> tuple[int, int]:
        return self.max_num_batched_tokens, self.max_num_seqs


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def preset_batch(
    preset: str, defaults: tuple[int, int], max_model_len: int, p95_input: int, target: int, kv_requests: int
) -> Batch:
    """The preset's batch for one instance.

    ``defaults``: vLLM's (batched tokens, sequences) on these GPUs; ``kv_requests``: the workload's
    requests whose KV fits in one instance's cache at once; ``target``: the requests in flight the
    workload wants of this instance. ``ValueError`` for an unknown preset (the schema refuses it first).
    """
    tokens_default, seqs_default = defaults
    fits = max(1, kv_requests)
    vllm = f"vLLM's default on these GPUs: {tokens_default} tokens, {seqs_default} sequences"
    if preset == "throughput":
        tokens = 2 * tokens_default
        seqs = min(2 * seqs_default, fits)
        tokens_why = f"throughput preset: twice {vllm} (as vLLM's --performance-mode throughput); larger steps"
        seqs_why = f"throughput preset: the {fits} requests of the workload the KV cache holds at once" + (
            f" (vLLM's {2 * seqs_default} would be preempted and recomputed)" if fits < 2 * seqs_default else ""
        )
    elif preset == "latency":
        tokens = LATENCY_BATCHED_TOKENS
        seqs = min(target, fits, seqs_default)
        tokens_why = (
            f"latency preset: {LATENCY_BATCHED_TOKENS} tokens per step, so fewer prefill tokens slow each decode "
            f"(vLLM's Optimization and Tuning; {vllm})"
        )
        seqs_why = f"latency preset: the workload's target of {target} in flight" + (
            f", capped at the {fits} the KV cache holds" if fits < target else ""
        )
    elif preset == "long_context":
        tokens = max(tokens_default, min(_round_up(p95_input, CHUNK), LONG_CONTEXT_MAX_BATCHED_TOKENS))
        seqs = min(fits, seqs_default)
        tokens_why = (
            f"long-context preset: the p95 input of {p95_input} tokens prefilled in "
            f"{-(-p95_input // tokens)} step(s) (at most {LONG_CONTEXT_MAX_BATCHED_TOKENS}; {vllm})"
        )
        seqs_why = f"long-context preset: the {fits} requests of the workload the KV cache holds at once"
    else:
        raise ValueError(f"unknown serving preset {preset!r}: one of {', '.join(PRESETS)}")
    seqs = max(1, seqs)
    tokens = max(tokens, seqs)  # vLLM refuses max_num_batched_tokens < max_num_seqs
    tokens = min(tokens, max(seqs * max_model_len, seqs))  # vLLM warns above max_num_seqs × max_model_len
    return Batch(preset, tokens, seqs, tokens_why, seqs_why)
