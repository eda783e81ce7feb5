"""Reading what trials report: TRL / ms-swift log dicts, autotune's metrics file, and the throughput math."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autotune.trial.logparse import LogParser, parse_log_dicts
from autotune.trial.mapping import MAX_LITERAL_CHARS, parse_mapping
from autotune.trial.metrics import (
    MetricsTail,
    StepRecord,
    parse_metrics_line,
    read_metrics_file,
    steady_throughput,
)
from autotune.units import duration_seconds

LOGS = Path(__file__).parent / "data" / "logs"


def parse_file(name: str, **kwargs) -> LogParser:
    parser = LogParser(**kwargs)
    for line in (LOGS / name).read_text(encoding="utf-8").split("\n"):
        parser.feed(line)
    return parser


# --------------------------------------------------------------------------------------------
# TRL / HF log dicts
# --------------------------------------------------------------------------------------------

TINY_GRPO = """
import json, sys, tempfile
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
from trl import GRPOConfig, GRPOTrainer

texts = ["the cat sat on the mat", "a dog ran in the park", "hello world"] * 8
raw = Tokenizer(models.BPE(unk_token="<unk>"))
raw.pre_tokenizer = pre_tokenizers.Whitespace()
raw.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<pad>", "<eos>"]))
tok = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>")
model = Qwen2ForCausalLM(Qwen2Config(vocab_size=tok.vocab_size, hidden_size=16, intermediate_size=32,
                                     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                     max_position_embeddings=64))
args = GRPOConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=4, num_generations=2,
                  max_completion_length=6, max_steps=3, logging_steps=1, use_cpu=True, bf16=False,
                  report_to=[], save_strategy="no", seed=0)
trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions],
                      args=args, train_dataset=Dataset.from_dict({"prompt": texts}), processing_class=tok)
trainer.train()
print("LOG_HISTORY " + json.dumps(trainer.state.log_history), flush=True)
"""


def test_a_real_tiny_grpo_run_on_cpu():
    """Run TRL for real (3 steps, ~5 s) and read its stdout+stderr as a trial's log would be read."""
    pytest.importorskip("trl")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(TINY_GRPO)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=180,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:]
    history_line = next(line for line in proc.stdout.splitlines() if line.startswith("LOG_HISTORY "))
    history = json.loads(history_line[len("LOG_HISTORY ") :])
    steps = [h for h in history if "step_time" in h]

    parser = LogParser()
    for line in proc.stdout.splitlines():
        if not line.startswith("LOG_HISTORY "):
            parser.feed(line)
    records = parser.records
    assert [r.step for r in records] == [h["step"] for h in steps] == [1, 2, 3]
    for record, logged in zip(records, steps):
        # printed with 4 significant digits (transformers 5), logged exactly
        assert record.step_time == pytest.approx(logged["step_time"], rel=1e-3)
        assert record.span == 1
    assert sum(r.tokens for r in records) == pytest.approx(steps[-1]["num_tokens"], abs=3)
    assert parser.final is not None and parser.final["train_runtime"] > 0
    assert steady_throughput(records, warmup_steps=1, samples_per_step=4) > 0


def test_trl_fixture_with_progress_bars_and_wall_clock():
    """Captured TRL 1.16 output: values are '.4g' strings, dicts share lines with tqdm redraws."""
    parser = parse_file("trl_grpo_cpu_merged.log")
    records = parser.records
    assert [r.step for r in records] == [1, 2, 3, 4]
    assert [r.step_time for r in records] == [0.09192, 0.04409, 0.0404, 0.02956]
    assert [r.tokens for r in records] == [90, 101, 83, 96]  # from the cumulative num_tokens
    assert [r.elapsed for r in records] == [0.1036, 0.1518, 0.1953, 0.2279]  # per-step train_runtime
    assert parser.final["train_runtime"] == 0.2281
    assert parser.final["train_samples_per_second"] > 0
    # 4 completions per device x 2 accumulation steps per optimizer step; the wall clock is used
    assert steady_throughput(records, warmup_steps=1, samples_per_step=8) == pytest.approx(
        8 * 3 / (0.2279 - 0.1036)
    )
    # without the clock, TRL's step_time (which leaves out the optimizer step) is what there is
    no_clock = [StepRecord(r.step, r.step_time) for r in records]
    assert steady_throughput(no_clock, 1, 8) == pytest.approx(8 * 3 / (0.04409 + 0.0404 + 0.02956))


def test_hf_dicts_in_older_and_numpy_forms():
    parser = LogParser()
    assert parser.feed(
        "[rank0]: {'loss': np.float64(0.5), 'grad_norm': tensor(0.25, device='cuda:0'), "
        "'learning_rate': 1e-06, 'step_time': 2.0, 'epoch': 0.1}"
    ) == StepRecord(step=1, step_time=2.0)
    assert parser.feed("{'loss': nan, 'step_time': np.float32(3.0), 'epoch': 0.2}").step_time == 3.0
    assert parser.feed("[transformers] Updated tokens: {'eos_token_id': 2}.") is None
    assert parser.feed("{'eval_loss': 0.1, 'eval_runtime': 3.2, 'epoch': 0.2}") is None
    assert parser.feed("{'loss': 0.1, 'step_time': 2.5, 'step': 7}").step == 7  # an explicit step wins
    assert parser.feed("{'loss': 0.1, 'step_time': 2.5, 'step': 7}") is None  # the same step again
    assert [r.step for r in parser.records] == [1, 2, 7]
    assert parser.records[-1].span == 5


def test_logging_steps_counts_steps_between_dicts():
    parser = LogParser(logging_steps=5)
    parser.feed("{'loss': '0.1', 'step_time': '40', 'epoch': '0.1'}")
    parser.feed("{'loss': '0.1', 'step_time': '41', 'epoch': '0.2'}")
    assert [(r.step, r.span) for r in parser.records] == [(5, 5), (10, 5)]
    assert steady_throughput(parser.records, warmup_steps=5, samples_per_step=64) == pytest.approx(64 / 41)
    with pytest.raises(ValueError):
        LogParser(logging_steps=0)


def test_metrics_json_lines_on_stdout_are_read_too():
    parser = LogParser()
    record = parser.feed(
        '{"step": 3, "step_time": 41.2, "samples": 256, "tokens": 393216, "peak_memory_gib": 71.3}'
    )
    assert record == StepRecord(step=3, step_time=41.2, samples=256, tokens=393216, peak_memory_gib=71.3)


def test_parse_log_dicts_finds_dicts_in_noise():
    line = "\r 25%|██▌ | 1/4 [00:00<00:00]\r     \r\x1b[32m{'a': '1', 'b': 'x}y', 'c': [1, {'d': 2}]}\x1b[0m tail {'e': 3}"
    assert parse_log_dicts(line) == [{"a": "1", "b": "x}y", "c": [1, {"d": 2}]}, {"e": 3}]
    assert parse_log_dicts("no dict {here") == []
    assert isinstance(parse_log_dicts("{not: a dict, {really}"), list)  # lenient, never raises


def test_python_repr_values_that_real_logs_print():
    d = parse_mapping(
        "{'a': nan, 'b': -inf, 'c': Infinity, 'd': -Infinity, 'e': INF, 'f': None, 'g': null, 'h': true,"
        " 'i': False, 'j': np.float64(0.1), 'k': tensor(0.5, device='cuda:0', dtype=torch.bfloat16),"
        " 'l': (1, -2.5e-06), 'm': array([1.0, 2.0], dtype=float32), 'n': +3, 7: 'seven', 'o': {'p': []},}"
    )
    assert d is not None
    assert math.isnan(d.pop("a"))
    assert d == {
        "b": -math.inf,
        "c": math.inf,
        "d": -math.inf,
        "e": math.inf,
        "f": None,
        "g": None,
        "h": True,
        "i": False,
        "j": 0.1,
        "k": 0.5,
        "l": [1, -2.5e-06],
        "m": [1.0, 2.0],
        "n": 3,
        "7": "seven",
        "o": {"p": []},
    }
    # JSON first (NaN, Infinity), and a text that is JSON but not a dict is no dict
    assert parse_mapping('{"x": Infinity, "y": -Infinity}') == {"x": math.inf, "y": -math.inf}
    assert parse_mapping("[1, 2]") is None


def test_only_plain_data_is_read():
    for text in (
        "{'a': foo}",
        "{'a': __import__('os').getcwd()}",
        "{'a': 1 + 2}",
        "{'a': x.y}",
        "{'a': [i for i in 'ab']}",
        "{**other}",
        "{'a': {1, 2}}",
        "{'a': -'x'}",
        "{'a': lambda: 1}",
        "{'a': f'{1}'}",
        "{'a': b'x'}",
        "{['a']: 1}",
        "{'a': 1",
    ):
        assert parse_mapping(text) is None, text


def test_a_huge_dict_line_is_refused_quickly():
    huge = "{" + ", ".join(f"'k{i}': np.float64({i}.5)" for i in range(20000)) + "}"
    assert len(huge) > MAX_LITERAL_CHARS
    started = time.monotonic()
    assert parse_mapping(huge) is None
    assert parse_log_dicts("[rank0]: " + huge) == []
    assert LogParser().feed(huge) is None
    assert time.monotonic() - started < 5
    # just under the limit it is read as usual
    fits = "{" + ", ".join(f"'k{i}': {i}" for i in range(4000)) + "}"
    assert len(fits) < MAX_LITERAL_CHARS and len(parse_mapping(fits)) == 4000


class _CyclicGarbage:
    """An object only the cycle collector frees; its finalizer runs Python code that lets another
    thread in, as any library's ``__del__`` may while a log line is being parsed."""

    def __init__(self) -> None:
        self.me = self

    def __del__(self) -> None:
        time.sleep(0)


def _failing_index(k: int) -> int:
    values = {"a": [1, 2, 3]}
    return values["a"][k] + (values["a"][0] * 2)


def test_trials_parse_dicts_at_once_without_tripping_the_interpreter():
    """A parallel search reads several trials' printed dicts at once, each in its trial's launch
    thread, while other threads may log an exception: CPython 3.11's ``ast.parse`` is not safe to run
    in two threads at once (CI died of "SystemError: AST constructor recursion depth mismatch" in a
    parallel search), and 3.11's ``traceback`` parses too, to place its ``^^^`` marks. Every parse of
    autotune's goes through one lock and is run again if the standard library's broke it, so three
    threads reading Python-repr dicts amid garbage collections, beside one formatting tracebacks,
    read every dict."""
    import threading
    import traceback

    line = "{" + ", ".join(f"'k{i}': [{i}, ({i}, {{'loss': np.float64(0.{i})}})]" for i in range(100)) + "}"
    expected = parse_mapping(line)
    assert expected is not None and len(expected) == 100
    failures: list[BaseException] = []
    wrong: list[object] = []
    done = threading.Event()

    def read(times: int) -> None:
        for _ in range(times):
            for _ in range(50):
                _CyclicGarbage()
            try:
                got = parse_mapping(line)
            except BaseException as exc:  # the interpreter's SystemError is the failure looked for
                failures.append(exc)
                return
            if got != expected:
                wrong.append(got)

    def format_tracebacks() -> None:
        while not done.is_set():
            try:
                _failing_index(10)
            except IndexError as exc:
                try:
                    traceback.format_exception(exc)
                except SystemError:
                    pass  # the standard library's own parse lost the race: not autotune's to mend

    formatter = threading.Thread(target=format_tracebacks)
    readers = [threading.Thread(target=read, args=(60,)) for _ in range(3)]
    formatter.start()
    for reader in readers:
        reader.start()
    for reader in readers:
        reader.join()
    done.set()
    formatter.join()
    assert not failures, repr(failures[0])
    assert not wrong


def test_malformed_or_deeply_nested_lines_give_no_dict():
    deep = "{'a': " + "[" * 5000 + "]" * 5000 + "}"
    deep_calls = "{'a': " + "f(" * 5000 + "1" + ")" * 5000 + "}"
    deep_dicts = "{'a': " * 400 + "1" + "}" * 400
    for text in (
        deep,
        deep_calls,
        "{'a': " + "-" * 5000 + "1}",
        "{'a': 1,, 'b': 2}",
        "{'a' 1}",
        "{'a': '\\x'}",
        "{'a': 1\x00}",
        "{'a': 007}",
        "{'a': 1 2}",
    ):
        assert parse_mapping(text) is None, text[:40]
        assert parse_log_dicts(text) == [], text[:40]
        assert LogParser().feed(text) is None
    # a nest too deep for Python's parser (200 levels) is refused as a whole, then the dicts inside
    # it are tried: the outermost one that can be read is found
    (found,) = parse_log_dicts(deep_dicts)
    depth = 0
    while isinstance(found, dict):
        found, depth = found["a"], depth + 1
    assert found == 1 and 100 <= depth < 400


# --------------------------------------------------------------------------------------------
# ms-swift
# --------------------------------------------------------------------------------------------


def test_swift_cumulative_iter_per_s_gives_per_step_times():
    """Real ms-swift output: logging every 5 steps, 'train_speed(iter/s)' = global_step / elapsed."""
    parser = parse_file("swift_sft_iter_per_s.log")
    records = parser.records
    assert [r.step for r in records] == [1] + list(range(5, 95, 5))
    assert [r.span for r in records[:3]] == [1, 4, 5]
    assert records[0].step_time == pytest.approx(1 / 0.345807)
    assert records[1].step_time == pytest.approx((5 / 0.461462 - 1 / 0.345807) / 4)
    assert records[2].step_time == pytest.approx((10 / 0.485796 - 5 / 0.461462) / 5)
    assert records[-1].elapsed == pytest.approx(90 / 0.520707)
    # per-step times are about 2 s, as the progress bar says (1.95s/it), not the cumulative 1/speed
    assert all(1.8 < r.step_time < 2.1 for r in records[1:])
    assert [r.peak_memory_gib for r in records[:4]] == [4.87, 5.64, 5.64, 6.5]
    assert parser.peak_memory_gib == 6.5 and max(r.peak_memory_gib for r in records) == 6.5
    assert parser.final["train_runtime"] == 183.4332 and parser.final["global_step/max_steps"] == "94/94"
    # 16 completions per step: the wall clock from step 5 to step 90
    expected = 16 * 85 / (90 / 0.520707 - 5 / 0.461462)
    assert steady_throughput(records, warmup_steps=5, samples_per_step=16) == pytest.approx(expected)


def test_swift_grpo_first_step():
    parser = parse_file("swift_grpo_iter_per_s.log")
    (record,) = parser.records
    # ms-swift <= 3.7 started this clock when the trainer was built, so the first "step" includes
    # set-up: 1 / 0.001975 = 506 s against elapsed_time '6m 58s'. It is a warm-up step anyway.
    assert record.step == 1 and record.step_time == pytest.approx(1 / 0.001975)
    assert record.peak_memory_gib == 104.33
    assert steady_throughput(parser.records, warmup_steps=1, samples_per_step=64) is None


def test_swift4_seconds_per_iteration_and_eval_lines():
    parser = parse_file("swift4_s_per_it_constructed.log")
    records = parser.records
    assert [(r.step, r.span) for r in records] == [(1, 1), (5, 4), (10, 5), (15, 5)]
    assert [r.step_time for r in records] == pytest.approx([95.2, 41.0, 40.5, (44.61 * 15 - 46.17 * 10) / 5])
    assert [r.peak_memory_gib for r in records] == [61.22, 71.3, 71.3, 71.3]
    assert parser.final is None


def test_swift_without_speed_falls_back_to_elapsed_time():
    parser = LogParser()
    parser.feed(
        "{'loss': 0.1, 'global_step/max_steps': '2/10', 'elapsed_time': '1m 40s', 'memory(GiB)': 30.0}"
    )
    parser.feed(
        "{'loss': 0.1, 'global_step/max_steps': '4/10', 'elapsed_time': '3m 0s', 'memory(GiB)': 29.0}"
    )
    assert [(r.step, r.step_time, r.peak_memory_gib) for r in parser.records] == [
        (2, 50.0, 30.0),
        (4, 40.0, 30.0),
    ]


def test_swift_elapsed_time_formats():
    """ms-swift's format_time output, read by units.duration_seconds."""
    assert duration_seconds("2d 16h 57m 8s") == 2 * 86400 + 16 * 3600 + 57 * 60 + 8
    assert duration_seconds("1m 5s") == 65 and duration_seconds("34s") == 34 and duration_seconds("0s") == 0
    assert (
        duration_seconds("soon") is None
        and duration_seconds(None) is None
        and duration_seconds("3 apples 4s") is None
    )


def test_swift_elapsed_time_without_units_is_not_a_clock():
    # duration_seconds reads a bare number as seconds; ms-swift always writes units, so a
    # unit-less (or upper-case) elapsed_time is not its clock and gives no step time
    for elapsed in ("100", "1m 40", "1M 40S", 100):
        parser = LogParser()
        parser.feed(f"{{'loss': 0.1, 'global_step/max_steps': '2/10', 'elapsed_time': {elapsed!r}}}")
        assert [(r.step, r.step_time, r.elapsed) for r in parser.records] == [(2, None, None)], elapsed


# --------------------------------------------------------------------------------------------
# autotune's metrics file
# --------------------------------------------------------------------------------------------


def test_read_metrics_file_with_a_partial_last_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(
        '{"step": 1, "step_time": 50.1, "samples": 256, "tokens": 393216, "peak_memory_gib": 70.2}\n'
        '{"step": 2, "step_time": 41.2, "samples": 256.0, "gpu_util": 0.93}\n'
        "not json at all\n"
        "\n"
        '{"step": 3, "step_time": 41.0, "samples": null, "tokens": "many"}\n'
        '{"step": 4, "step_time": NaN, "samples": 2.5}\n'
        '{"step": 5, "step_ti'
    )
    records = read_metrics_file(path)
    assert records == [
        StepRecord(step=1, step_time=50.1, samples=256, tokens=393216, peak_memory_gib=70.2),
        StepRecord(step=2, step_time=41.2, samples=256),
        StepRecord(step=3, step_time=41.0),
        StepRecord(step=4),
    ]
    assert read_metrics_file(tmp_path / "missing.jsonl") == []


def test_parse_metrics_line_rejects_foreign_lines():
    assert parse_metrics_line("") is None
    assert parse_metrics_line("[1, 2]") is None
    assert parse_metrics_line('{"step_time": 3}') is None  # no step
    assert parse_metrics_line('{"step": -1}') is None
    assert parse_metrics_line('{"step": true}') is None
    assert parse_metrics_line('  {"step": 2}  \n') == StepRecord(step=2)


def test_metrics_tail_reads_only_complete_lines(tmp_path):
    path = tmp_path / "metrics.jsonl"
    tail = MetricsTail(path)
    assert tail.poll() == []  # not there yet
    with open(path, "w") as fh:
        fh.write('{"step": 1, "step_time": 5.0}\n{"step": 2, "step_')
        fh.flush()
        assert [r.step for r in tail.poll()] == [1]
        fh.write('time": 4.0}\n')
        fh.flush()
        assert tail.poll() == [StepRecord(step=2, step_time=4.0)]
        assert tail.poll() == []
    assert [r.step for r in tail.records] == [1, 2]
    path.write_text('{"step": 1}\n')  # replaced by a shorter file: start over
    assert tail.poll() == [StepRecord(step=1)]


@settings(max_examples=60, deadline=None)
@given(
    step=st.integers(min_value=0, max_value=10**6),
    step_time=st.none() | st.floats(min_value=1e-3, max_value=1e6),  # the plausible range
    samples=st.none() | st.integers(min_value=0, max_value=10**6),
    tokens=st.none() | st.integers(min_value=0, max_value=10**12),
    peak=st.none() | st.floats(min_value=0, max_value=1e4),
)
def test_metrics_line_round_trip(step, step_time, samples, tokens, peak):
    record = StepRecord(step=step, step_time=step_time, samples=samples, tokens=tokens, peak_memory_gib=peak)
    line = json.dumps(record.to_json(), separators=(", ", ": "))  # what a trainer appends
    assert "\n" not in line and json.loads(line)["step"] == step
    assert parse_metrics_line(line) == record


@pytest.mark.parametrize(
    "line, dropped",
    [
        ('{"step": 3, "step_time": ' + "9" * 400 + ', "samples": 64}', "step_time"),  # OverflowError before
        ('{"step": 3, "step_time": 1.0, "samples": 1e308}', "samples"),  # inf in outcome.json
        ('{"step": 3, "step_time": 1e-300, "samples": 64}', "step_time"),  # 6.4e301 completions/s
        ('{"step": 3, "step_time": 2.0, "peak_memory_gib": 1e30}', "peak_memory_gib"),
    ],
)
def test_implausible_metrics_values_are_dropped_not_trusted(line, dropped):
    record = parse_metrics_line(line)
    assert record is not None and record.step == 3 and getattr(record, dropped) is None
    parser = LogParser()
    parser.feed(str({"loss": "0.1", "step_time": "1e-300"}))
    assert [(r.step, r.step_time) for r in parser.records] == [
        (1, None)
    ]  # the step counts, its time does not


# --------------------------------------------------------------------------------------------
# Throughput math
# --------------------------------------------------------------------------------------------


def test_steady_throughput_excludes_warmup():
    records = [StepRecord(1, step_time=30.0, samples=100)] + [
        StepRecord(s, step_time=10.0, samples=100) for s in range(2, 6)
    ]
    assert steady_throughput(records, warmup_steps=1, samples_per_step=None) == pytest.approx(10.0)
    assert steady_throughput(records, warmup_steps=0, samples_per_step=None) == pytest.approx(500 / 70)


def test_steady_throughput_sample_fallback_and_not_enough_data():
    records = [StepRecord(s, step_time=4.0) for s in range(1, 4)]
    assert steady_throughput(records, 1, samples_per_step=64) == pytest.approx(16.0)
    assert steady_throughput(records, 1, samples_per_step=None) is None
    assert steady_throughput(records, 3, samples_per_step=64) is None  # all warm-up
    assert steady_throughput([], 0, 64) is None
    assert steady_throughput([StepRecord(2), StepRecord(3)], 1, 64) is None  # no times
    mixed = [StepRecord(2, step_time=4.0, samples=32), StepRecord(3, step_time=4.0)]
    assert steady_throughput(mixed, 1, samples_per_step=64) == pytest.approx(96 / 8)


def test_steady_throughput_uses_the_last_record_of_a_repeated_step():
    records = [
        StepRecord(2, step_time=100.0, samples=10),
        StepRecord(3, step_time=5.0, samples=10),
        StepRecord(2, step_time=5.0, samples=10),
    ]
    assert steady_throughput(records, 1, None) == pytest.approx(2.0)


def test_steady_throughput_weights_spans():
    records = [StepRecord(5, step_time=2.0, span=4), StepRecord(10, step_time=4.0, span=5)]
    # warm-up ends at step 3: two of the first record's four steps count
    assert steady_throughput(records, 3, samples_per_step=10) == pytest.approx(
        (2 * 10 + 5 * 10) / (2 * 2.0 + 5 * 4.0)
    )


def test_steady_throughput_prefers_a_wall_clock():
    # TRL's step_time leaves out the optimizer step: the clock says 1.25 s per step, not 1.0
    records = [StepRecord(s, step_time=1.0, elapsed=2.0 + 1.25 * (s - 1)) for s in range(1, 6)]
    assert steady_throughput(records, 1, samples_per_step=10) == pytest.approx(10 / 1.25)
    # a record without the clock after warm-up: back to step times
    records[3] = StepRecord(4, step_time=1.0)
    assert steady_throughput(records, 1, samples_per_step=10) == pytest.approx(10.0)
