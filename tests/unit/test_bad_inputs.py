# ruff: noqa: E501  (the corpus is a table: one case per line reads best)
"""Bad inventories, as a hostile or careless operator writes them: each one gets a clear error.

A corpus by class (injection, secrets, would-be tracebacks, silently wrong plans, messages,
cross-host rules), each case with the exit code and the message it must produce. Every case is
run through the real CLI (``fleet plan``, human and ``--json``) and must also: print no
traceback, echo no secret, and leave nothing in the ``--render`` directory unless it plans.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from click.testing import CliRunner

from fleet.cli import main

WL = '{"p95_input_tokens": 1000, "p95_output_tokens": 200, "prefix_reuse": 0.2, "target_concurrency": 4}'
OK = f'"model": "meta-llama/Llama-3.1-8B-Instruct", "workload": {WL}, "gpu": {{"sku": "a10-24gb"}}'
KEY = "sk-proj-Zx81Qw7Lm2Pv9Rt4Yu6Io3Pa5Sd"  # shaped like a real key; must never be printed
HF = "hf_QwErTyUiOpAsDfGhJkLzXcVbNm1234"


@dataclass
class Case:
    name: str
    kind: str  # injection | secrets | traceback | silent | messages | cross-host
    inventory: str
    expect: list[str]  # substrings of the error (human output), in any order
    code: int = 2
    group_data: dict[str, str] = field(default_factory=dict)
    secrets: tuple[str, ...] = ()


def host(data: str, name: str = "h1") -> str:
    return f'g = [("{name}", {{{OK}, {data}}})]\n'


CASES = [
    # -- injection: values that would add lines, options or paths ------------------------------
    Case("host name with a line break", "injection",
         'g = [("h1\\nExecStartPre=+/bin/sh -c id", {' + OK + "})]\n", ["host name", "not a host name"]),
    Case("host name with CR", "injection", 'g = [("h1\\rx", {' + OK + "})]\n", ["not a host name"]),
    Case("host name ../x", "injection", 'g = [("../x", {' + OK + "})]\n", ["'../x'", "not a host name"]),
    Case("host name /tmp/x", "injection", 'g = [("/tmp/x", {' + OK + "})]\n", ["'/tmp/x'", "not a host name"]),
    Case("host name /", "injection", 'g = [("/", {' + OK + "})]\n", ["host name='/'"]),
    Case("empty host name", "injection", 'g = [("", {' + OK + "})]\n", ["host name=''"]),
    Case("host name with NUL", "injection", 'g = [("h\\x00", {' + OK + "})]\n", ["not a host name"]),
    Case("served name with a line break", "injection",
         host('"served_model_name": "x\\nExecStartPre=/bin/sh"'), ["served_model_name=", "no line breaks"]),
    Case("served name with NUL", "injection", host('"served_model_name": "x\\x00y"'), ["served_model_name="]),
    Case("served name as an option", "injection", host('"served_model_name": "--trust-remote-code"'),
         ["served_model_name='--trust-remote-code'", "not starting with '-'"]),
    Case("model as an option", "injection", 'g = [("h1", {"model": "--trust-remote-code", "workload": ' + WL + "})]\n",
         ["model='--trust-remote-code'", "Hugging Face model id"]),
    Case("model with a line break", "injection", 'g = [("h1", {"model": "a/b\\nc", "workload": ' + WL + "})]\n",
         ["model="]),
    Case("model path with a line break", "injection",
         'g = [("h1", {"model": "/models/x\\nExecStartPre=/bin/sh", "workload": ' + WL + "})]\n", ["model=", "path"]),
    Case("model path with ..", "injection", 'g = [("h1", {"model": "/models/../etc", "workload": ' + WL + "})]\n",
         ["without '.' or '..'"]),
    Case("bind address with a line break", "injection", host('"bind_address": "0.0.0.0\\nExecStartPre=/bin/sh"'),
         ["bind_address=", "IPv4 or IPv6"]),
    Case("bind address any string", "injection", host('"bind_address": "everywhere"'), ["bind_address='everywhere'"]),
    Case("vllm version with a space", "injection", host('"vllm_version": "0.33.0 --x"'), ["a release version"]),
    Case("lab profile (removed key)", "silent", host('"lab_profile": "../../etc/passwd"'), ["no longer read"]),
    Case("pip index not a url", "injection", host('"pip_index_url": "not a url"'), ["pip_index_url='not a url'"]),
    Case("pip index file scheme", "injection", host('"pip_index_url": "file:///etc"'), ["http:// or https://"]),
    # -- secrets: refused, never echoed ------------------------------------------------------------
    Case("key under api_key", "secrets", host(f'"api_key": "{KEY}"'), ["api_key=<redacted>", "api_key_ref"],
         secrets=(KEY,)),
    Case("short key under api_key", "secrets", host('"api_key": "letmein"'), ["api_key=<redacted>"],
         secrets=("letmein",)),
    Case("key as api_key_ref", "secrets", host(f'"api_key_ref": "{KEY}"'), ["api_key_ref=<redacted>", "env:VARIABLE"],
         secrets=(KEY,)),
    Case("key with a colon as api_key_ref", "secrets", host('"api_key_ref": "token:abc123def456"'),
         ["api_key_ref=<redacted>"], secrets=("abc123def456",)),
    Case("key as a dict", "secrets", host('"api_key_ref": {"value": "p4ssw0rd-value"}'), ["api_key_ref=<redacted>"],
         secrets=("p4ssw0rd-value",)),
    Case("key as bytes", "secrets", host(f'"api_key_ref": b"{KEY}"'), ["api_key_ref=<redacted>"], secrets=(KEY,)),
    Case("key under a misspelt field", "secrets", host(f'"api_key_rf": "{KEY}"'),
         ["api_key_rf=<redacted>", "did you mean 'api_key_ref'"], secrets=(KEY,)),
    Case("short value under a misspelt ref", "secrets", host('"api_key_rf": "mysecretvalue"'),
         ["api_key_rf=<redacted>"], secrets=("mysecretvalue",)),
    Case("key under an unrelated field", "secrets", host(f'"rack": "{HF}"'), ["rack=<redacted>", "looks like a secret"],
         secrets=(HF,)),
    Case("key inside a list", "secrets", host(f'"notes": ["fine", "{KEY}"]'), ["notes[1]=<redacted>"], secrets=(KEY,)),
    Case("password field", "secrets", host('"ssh_password": "hunter2hunter2"'), ["ssh_password=<redacted>"],
         secrets=("hunter2hunter2",)),
    Case("credentials in the index url", "secrets", host('"pip_index_url": "https://bob:s3cretpw@pypi.internal/simple"'),
         ["pip_index_url=<redacted>"], secrets=("s3cretpw",)),
    Case("key as a host name", "secrets", f'g = [("{HF}", {{' + OK + "})]\n", ["host name=<redacted>"], secrets=(HF,)),
    Case("key as a field name", "secrets", host(f'"{HF}": 1'), ["<a field name>=<redacted>"], secrets=(HF,)),
    Case("key in an exception message", "secrets", f'raise ValueError("bad {KEY}")\n', ["does not run: ValueError"],
         secrets=(KEY,)),
    # -- would-be tracebacks ----------------------------------------------------------------------
    Case("host data not a dict", "traceback", 'g = [("h1", "model=a/b")]\n', ["host data", "a dict"]),
    Case("host data a list", "traceback", 'g = [("h1", ["model", "a/b"])]\n', ["a dict"]),
    Case("non-string key", "traceback", host('5: "x"'), ["field names are strings"]),
    Case("non-string host name", "traceback", 'g = [(5, {' + OK + "})]\n", ["a host name is a string"]),
    Case("a 3-tuple host", "traceback", 'g = [("h1", {}, 3)]\n', ["is \"name\" or"]),
    Case("group as a tuple of names", "silent", 'web = ("h1", "h2")\n', ["group web=('h1', 'h2')", "a tuple ([hosts], {data})"]),
    Case("group data not a dict", "traceback", 'g = (["h1"], "data")\n', ["group g data"]),
    Case("NaN prefix reuse", "traceback",
         'g = [("h1", {"model": "a/b", "workload": {"p95_input_tokens": 1, "p95_output_tokens": 1, '
         '"prefix_reuse": float("nan"), "target_concurrency": 1}})]\n', ["workload.prefix_reuse=nan", "finite"]),
    Case("infinite memory", "traceback", host('"gpu": {"memory_gib": float("inf")}').replace(', "gpu": {"sku": "a10-24gb"}', ""),
         ["finite"]),
    Case("list where a string belongs", "traceback", host('"served_model_name": ["a", "b"]'),
         ["served_model_name=['a', 'b']", "valid string"]),
    Case("workload a string", "traceback", 'g = [("h1", {"model": "a/b", "workload": "chat"})]\n',
         ["workload='chat'", "must be a dict"]),
    Case("a list that contains itself", "traceback", "_l = []\n_l.append(_l)\n" + host('"served_model_name": _l'),
         ["served_model_name=None: nested more than 8 levels deep, or contains itself"]),
    Case("a value whose repr and == raise", "traceback",
         "class _E:\n    def __repr__(self):\n        raise RuntimeError\n    def __eq__(self, o):\n        raise RuntimeError\n"
         "    __hash__ = object.__hash__\n" + 'a = [("h1", {' + OK + ', "rack": _E(), "port": _E()})]\nb = [("h1", {"port": _E()})]\n',
         ["port=<_E object>: must be a valid integer", "defined twice with different port"]),
    Case("an integer too long to print", "traceback", host('"port": 10**5000'), ["port=<int object>: must be less than or equal to 65535"]),
    Case("a generator as a value", "traceback", host('"workload": (x for x in [])'), ["workload=<generator object", "must be a dict"]),
    Case("syntax error", "traceback", "g = [\n", ["does not run: SyntaxError"]),
    Case("exception in the inventory", "traceback", "g = []\nraise KeyError('x')\n", [":2: the file does not run: KeyError"]),
    Case("syntax error in group_data", "traceback", 'g = [("h1", {' + OK + "})]\n", ["group_data/g.py:1:", "SyntaxError"],
         group_data={"g": "port = (\n"}),
    Case("exception in group_data", "traceback", 'g = [("h1", {' + OK + "})]\n",
         ["group_data/g.py:2: the file does not run: ZeroDivisionError"], group_data={"g": "x = 1\ny = 1 / 0\n"}),
    Case("sys.exit in group_data", "traceback", 'g = [("h1", {' + OK + "})]\n", ["group_data/g.py:2:", "sys.exit(3)"],
         group_data={"g": "import sys\nsys.exit(3)\n"}),
    # -- silently wrong plans ---------------------------------------------------------------------
    Case("sys.exit(0) in the inventory", "silent", "import sys\ng = ['h1']\nsys.exit(0)\n",
         [":3: the file calls sys.exit(0)"]),
    Case("NaN utilization", "silent", host('"gpu_memory_utilization": float("nan")'), ["gpu_memory_utilization=nan"]),
    Case("utilization 1.0", "silent", host('"gpu_memory_utilization": 1.0'), ["less than or equal to 0.95"]),
    Case("Port in the wrong case", "silent", host('"Port": 9000'), ["Port=9000", "did you mean 'port'"]),
    Case("near-miss key", "silent", host('"served_model_nmae": "x"'), ["did you mean 'served_model_name'"]),
    Case("served_name for served_model_name", "silent", host('"served_name": "x"'),
         ["served_name='x': unknown field", "did you mean 'served_model_name'", "name it x_served_name", "user_keys"]),
    Case("a key that is nobody's", "silent", host('"rack": "r12"'), ["rack='r12': unknown field", "x_rack"]),
    Case("a misspelt pyinfra key", "silent", host('"ssh_usr": "fleet"'), ["ssh_usr='fleet'", "did you mean 'ssh_user'"]),
    Case("a fleet key declared the operator's own", "silent", host('"user_keys": ["port"]'),
         ["user_keys=['port']: 'port' is a key fleet reads"]),
    Case("near-miss workload key", "silent",
         'g = [("h1", {"model": "a/b", "workload": {"p95_input_tokens": 1, "p95_output_tokens": 1, '
         '"prefix_reuse": 0, "target_concurency": 1}})]\n', ["did you mean 'target_concurrency'"]),
    Case("sku and memory_gib", "silent", host('"gpu": {"sku": "a10-24gb", "memory_gib": 80}').replace(
        ', "gpu": {"sku": "a10-24gb"}', "", 1), ["give sku or memory_gib, not both"]),
    Case("nvlink switch on an L40S", "silent",
         host('"gpu": {"sku": "l40s-48gb", "nvlink": "switch"}').replace(', "gpu": {"sku": "a10-24gb"}', "", 1),
         ["l40s-48gb has no NVLink"]),
    Case("boolean as an integer", "silent", host('"prefix_caching": 1'), ["prefix_caching=1", "boolean"]),
    Case("integer as a boolean", "silent", host('"port": True'), ["port=True", "integer"]),
    Case("port as a string", "silent", host('"port": "8000"'), ["port='8000'", "integer"]),
    Case("privileged port", "silent", host('"port": 80'), ["port=80", "1024"]),
    Case("host twice with different data", "silent",
         'a = [("h1", {' + OK + ', "port": 8000})]\nb = [("h1", {"port": 9000})]\n',
         ["defined twice with different port", "group a says 8000", "group b says 9000"]),
    Case("api_key_ref is a plain word", "silent", host('"api_key_ref": "FLEET_KEY"'), ["api_key_ref=<redacted>"]),
    # -- messages: the right file, every problem at once -------------------------------------------
    Case("bad value in group_data names that file", "messages", 'g = ["h1"]\n',
         ["group_data/g.py: host h1: port=80"],
         group_data={"g": f'model = "meta-llama/Llama-3.1-8B-Instruct"\nworkload = {WL}\nport = 80\n'}),
    Case("missing key on one host and bad value on another", "messages",
         'g = [("h1", {"workload": ' + WL + '}), ("h2", {' + OK + ', "port": 1})]\n',
         ["host h1: model=None: required", "host h2: port=1"]),
    Case("bad value on one host and a missing model on another", "messages",
         'g = [("h1", {' + OK + ', "port": "8000"}), ("h2", {' + OK.replace("meta-llama/Llama-3.1-8B-Instruct", "nobody/none")
         + "})]\n", ["host h1: port='8000'", "host h2: model='nobody/none': no config.json for model 'nobody/none'"]),
    Case("every problem of a host at once", "messages", host('"port": 1, "weights": "int3", "kv_cache_dtype": "fp4"'),
         ["port=1", "weights='int3'", "kv_cache_dtype='fp4'"]),
    # -- cross-host rules ---------------------------------------------------------------------------
    Case("two hosts on one address and port", "cross-host",
         'g = [("h1", {' + OK + ', "ssh_hostname": "10.0.0.5"}), ("h2", {' + OK + ', "ssh_hostname": "10.0.0.5"})]\n',
         ["collides with host h2"]),
    Case("instance range over the next host's port", "cross-host",
         'g = [("h1", {' + OK.replace('{"sku": "a10-24gb"}', '{"sku": "l40s-48gb", "count": 4}')
         + ', "ssh_hostname": "m1"}), ("h2", {' + OK + ', "ssh_hostname": "m1", "port": 8002})]\n',
         ["vLLM port 8000-8003", "collides with host h2"]),
    Case("ssh port inside the serving range", "cross-host", host('"ssh_port": 8000'), ["collides with its own ssh port"]),
    Case("same bind address on two machines", "cross-host",
         'g = [("h1", {' + OK + ', "bind_address": "10.1.1.1"}), ("h2", {' + OK + ', "bind_address": "10.1.1.1"})]\n',
         ["on 10.1.1.1", "collides with host h2"]),
    Case("port range past 65535", "cross-host",
         host('"port": 65534').replace('{"sku": "a10-24gb"}', '{"sku": "l40s-48gb", "count": 4}'), ["port=65534: port 65534 + 4 GPU(s)", "past 65535"]),
]  # fmt: skip


def _write(tmp_path: Path, case: Case) -> Path:
    inv = tmp_path / "inv" / "fleet.py"
    inv.parent.mkdir()
    inv.write_text(case.inventory)
    if case.group_data:
        (inv.parent / "group_data").mkdir()
        for name, text in case.group_data.items():
            (inv.parent / "group_data" / f"{name}.py").write_text(text)
    return inv


def _run(args: list[str]) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, args, catch_exceptions=True)
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    return result.exit_code, result.stdout, result.stderr


def test_corpus_covers_every_class() -> None:
    kinds = {c.kind for c in CASES}
    assert kinds == {"injection", "secrets", "traceback", "silent", "messages", "cross-host"}
    assert len({c.name for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_inventory(case: Case, tmp_path: Path) -> None:
    inv = _write(tmp_path, case)
    render = tmp_path / "render"
    code, out, err = _run(["plan", str(inv), "--render", str(render)])
    text = out + err
    assert code == case.code, text
    for expected in case.expect:
        assert expected in text, f"{expected!r} not in:\n{text}"
    assert "Traceback" not in text
    assert not render.exists() or not any(render.rglob("*")), "invalid input must write nothing"
    jcode, jout, jerr = _run(["plan", str(inv), "--json"])
    assert jcode == case.code
    body = json.loads(jout)
    assert body["exit_code"] == case.code and body["problems"]
    for secret in case.secrets:
        for output in (out, err, jout, jerr):
            assert secret not in output
    # the file named is the file where the value is written
    files = {p["file"] for p in body["problems"]}
    assert all(re.search(r"(fleet\.py|group_data/\w+\.py)$", f) for f in files), files
