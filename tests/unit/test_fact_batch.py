"""Facts in one batch (``fleet.facts.batch``) and the deploy's fact cache (``fleet.deploy.factcache``),
against this machine's own shell through pyinfra's local connector (``@local``): each fact read
from the batch must equal the same fact read on its own, and a command on the host must empty
the cache."""

from __future__ import annotations

import base64
import hashlib
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

import pytest
from pyinfra.api.config import Config
from pyinfra.api.connect import connect_all
from pyinfra.api.facts import FactBase
from pyinfra.api.facts import get_fact as pyinfra_get_fact
from pyinfra.api.host import Host
from pyinfra.api.inventory import Inventory
from pyinfra.api.state import State
from pyinfra.facts.files import Directory, File, Sha1File
from pyinfra.facts.server import Arch, Groups, Os, Users, Which
from typing_extensions import override

from fleet.deploy import factcache
from fleet.errors import FleetError
from fleet.facts.batch import (
    HEADER,
    MISSING,
    NO_ANSWER,
    BatchAnswer,
    FactBatch,
    FactRequest,
    answer_of,
    batch_answers,
    lines_of,
)
from fleet.facts.releases import VllmReleases


class Printed(FactBase[list[str]]):
    """Prints ``text`` as is (``printf '%s'``): the edge cases of line splitting."""

    @override
    def command(self, text: str) -> str:
        import shlex

        return f"printf '%s' {shlex.quote(text)}"

    @override
    def process(self, output: list[str]) -> list[str]:
        return output


class Fails(FactBase[str]):
    @override
    def command(self) -> str:
        return "echo partial; exit 3"


class NeedsMissingCommand(FactBase[str]):
    @override
    def requires_command(self) -> str:
        return "fleet-no-such-command-here"

    @override
    def command(self) -> str:
        return "fleet-no-such-command-here --version"


@pytest.fixture
def local() -> Any:
    inventory = Inventory((["@local"], {}))
    state = State(inventory, Config())  # type: ignore[no-untyped-call]
    connect_all(state)
    host = inventory.get_host("@local")
    yield state, host
    for h in inventory:
        h.disconnect()  # type: ignore[no-untyped-call]


def batch(state: State, host: Host, requests: list[FactRequest]) -> dict[int, BatchAnswer]:
    answers: dict[int, BatchAnswer] = pyinfra_get_fact(
        state, host, FactBatch, kwargs={"commands": [r.shell() for r in requests]}
    )
    return answers


@pytest.mark.parametrize(
    "text", ["", "one", "one\n", "one\ntwo", "one\ntwo\n", "\n", "a\n\n", "\n\nb", "tab\there\n", "ünï\n"]
)
def test_lines_split_as_pyinfra_splits_a_commands_output(text: str) -> None:
    proc = subprocess.run(["sh", "-c", "printf '%s' \"$1\"", "x", text], capture_output=True, text=True, check=True)
    assert lines_of(proc.stdout) == [line.rstrip("\n") for line in proc.stdout.splitlines(keepends=True)]


def test_each_fact_from_the_batch_equals_the_fact_read_on_its_own(local: Any, tmp_path: Path) -> None:
    state, host = local
    f = tmp_path / "file"
    f.write_text("content\n")
    requests = [
        FactRequest(Sha1File, {"path": str(f)}),
        FactRequest(File, {"path": str(f)}),
        FactRequest(File, {"path": str(tmp_path / "absent")}),
        FactRequest(Sha1File, {"path": str(tmp_path / "absent")}),
        FactRequest(Directory, {"path": str(tmp_path)}),
        FactRequest(VllmReleases, {"root": str(tmp_path)}),
        FactRequest(Arch),
        FactRequest(Os),
        FactRequest(Groups),
        FactRequest(Users),
        FactRequest(Which, {"command": "sh"}),
        *[FactRequest(Printed, {"text": t}) for t in ("", "x", "x\n", "a\n\nb\n\n", "##0 not a marker\n")],
    ]
    answers = batch(state, host, requests)
    assert sorted(answers) == list(range(len(requests)))
    for i, r in enumerate(requests):
        alone = pyinfra_get_fact(state, host, r.fact, kwargs=dict(r.kwargs))
        assert answer_of(r, answers[i]) == alone, (r, answers[i])
    assert answer_of(requests[0], answers[0]) == hashlib.sha1(b"content\n").hexdigest()


def test_failed_or_missing_commands_are_left_to_pyinfra(local: Any) -> None:
    state, host = local
    requests = [FactRequest(Fails), FactRequest(NeedsMissingCommand), FactRequest(Arch)]
    answers = batch(state, host, requests)
    assert answers[0] == BatchAnswer(3, ["partial"])
    assert answers[1] == BatchAnswer(0, [MISSING])
    assert answer_of(requests[0], answers[0]) is NO_ANSWER
    assert answer_of(requests[1], answers[1]) is NO_ANSWER
    assert answer_of(requests[2], answers[2]) not in (NO_ANSWER, None)
    assert answer_of(requests[2], None) is NO_ANSWER


def _framed(statuses: list[str], outputs: list[bytes]) -> list[str]:
    return [
        " ".join([HEADER, *statuses]),
        *[str(len(o)) for o in outputs],
        base64.b64encode(b"".join(outputs)).decode(),
    ]


def test_the_batch_answer_is_read_by_its_sizes() -> None:
    outputs = [b"a\n", b"", b"no newline", b"x\n\ny\n"]
    assert batch_answers(["ignored", *_framed(["0", "3", "0", "1"], outputs)]) == {
        0: BatchAnswer(0, ["a"]),
        1: BatchAnswer(3, []),
        2: BatchAnswer(0, ["no newline"]),
        3: BatchAnswer(1, ["x", "", "y"]),
    }
    assert batch_answers(_framed([], [])) == {}


@pytest.mark.parametrize(
    "output",
    [
        [],
        ["0 YQo="],  # the format before this one
        _framed(["0", "0"], [b"a", b"b"])[:-1],  # cut short: no outputs
        [*_framed(["0", "0"], [b"a", b"b"])[:2], _framed(["0"], [b"ab"])[-1]],  # a size missing
        [*_framed(["0", "x"], [b"a", b"b"])],  # a status that is not a number
        [*_framed(["0", "0"], [b"a", b"b"])[:-1], "!!notbase64"],
        [*_framed(["0", "0"], [b"a", b"b"])[:-1], base64.b64encode(b"abc").decode()],  # more than the sizes
        [*_framed(["0", "0"], [b"a", b"b"])[:-1], base64.b64encode(b"a").decode()],  # less
    ],
)
def test_an_answer_that_is_not_whole_is_no_answer_for_every_fact(output: list[str]) -> None:
    assert batch_answers(output) == {}


class Raw(FactBase[list[str]]):
    """Prints the bytes ``octal`` spells (``printf`` escapes): output that is not UTF-8."""

    @override
    def command(self, octal: str) -> str:
        return f"printf '{octal}'"

    @override
    def process(self, output: list[str]) -> list[str]:
        return output


class Exits(FactBase[list[str]]):
    @override
    def command(self) -> str:
        return "echo before; exit 0; echo after"

    @override
    def process(self, output: list[str]) -> list[str]:
        return output


def test_edge_outputs_come_back_as_the_connector_splits_them(local: Any) -> None:
    """No trailing newline, empty output, lines that look like the batch's own header and size
    lines, a fact that ends with ``exit``, a fact that lists the batch's own command line: each
    answer as the fact read alone; bytes that are not UTF-8 (which the connector cannot decode:
    the fact alone fails) replaced, the other facts' answers intact."""
    state, host = local
    texts = ["", "x", "x\n\n", "\n", f"{HEADER} 0 0\n3\n3\nYWJj\n", f"{HEADER}", "12\n"]
    requests = [
        *[FactRequest(Printed, {"text": t}) for t in texts],
        FactRequest(Exits),
        FactRequest(Fails),
        FactRequest(Raw, {"octal": "\\377\\376ok\\n\\300"}),
        FactRequest(Arch),
    ]
    answers = batch(state, host, requests)
    assert sorted(answers) == list(range(len(requests)))
    for i, r in enumerate(requests[: len(texts) + 1]):
        alone = pyinfra_get_fact(state, host, r.fact, kwargs=dict(r.kwargs))
        assert answer_of(r, answers[i]) == alone, (r, answers[i])
    assert answers[len(texts)] == BatchAnswer(0, ["before"])
    assert answers[len(texts) + 1] == BatchAnswer(3, ["partial"])
    assert answers[len(texts) + 2] == BatchAnswer(0, ["\ufffd\ufffdok", "\ufffd"])
    assert answer_of(requests[-1], answers[len(requests) - 1]) == platform.machine()


class CommandLines(FactBase[list[str]]):
    """Every process's command line, in full (as ``ps -ww`` would list them)."""

    @override
    def command(self) -> str:
        return "ps -e -ww -o args="

    @override
    def process(self, output: list[str]) -> list[str]:
        return output


def test_a_fact_listing_processes_sees_no_answer_of_another_in_the_command_line(local: Any) -> None:
    """The batch's command line holds every fact's command; a fact that prints it (``ps``) must not
    be read as another fact's answer."""
    state, host = local
    requests = [FactRequest(Printed, {"text": "unique-mark-7f3a"}), FactRequest(CommandLines)]
    answers = batch(state, host, requests)
    assert answers[0] == BatchAnswer(0, ["unique-mark-7f3a"])
    assert any(HEADER in line for line in answers[1].lines)  # it did see the batch itself
    assert len(answers) == 2


def test_without_a_private_directory_the_batch_answers_nothing(tmp_path: Path) -> None:
    """``mktemp -d`` fails (here: ``TMPDIR`` is not a directory): no answer, every fact is read on its own."""
    command = FactBatch().command([FactRequest(Arch).shell(), "echo x"])
    env = {**os.environ, "TMPDIR": str(tmp_path / "absent")}
    done = subprocess.run(["sh", "-c", command], capture_output=True, text=True, env=env, check=False)
    assert done.returncode == 0 and done.stdout == ""
    assert FactBatch().process(lines_of(done.stdout)) == {}


def test_the_cache_serves_batched_facts_until_the_host_runs_a_command(local: Any, tmp_path: Path) -> None:
    state, host = local
    f = tmp_path / "file"
    f.write_text("one\n")
    listed = [FactRequest(Sha1File, {"path": str(f)}), FactRequest(Arch)]
    caches = factcache.install(state, [host], lambda _h: listed)
    cache = caches[host.name]
    first = host.get_fact(Sha1File, path=str(f))
    assert first == hashlib.sha1(b"one\n").hexdigest()
    assert (cache.stats.batched, cache.stats.hits, cache.stats.misses) == (2, 1, 0)
    assert host.get_fact(Arch) == subprocess.run(["uname", "-m"], capture_output=True, text=True).stdout.strip()
    # A read of something the list did not name goes to the host, and is then cached too.
    host.get_fact(File, path=str(f))
    host.get_fact(File, path=str(f))
    assert (cache.stats.hits, cache.stats.misses) == (3, 1)
    # Reads do not empty the cache; a command run on the host does (an operation's change).
    f.write_text("two\n")
    assert host.get_fact(Sha1File, path=str(f)) == first  # nothing ran through pyinfra: cached
    ok, _out = host.run_shell_command("true")
    assert ok and cache.stats.invalidations == 1
    assert host.get_fact(Sha1File, path=str(f)) == hashlib.sha1(b"two\n").hexdigest()
    assert cache.stats.misses == 2
    assert "1 read on their own" not in factcache.summary(caches)
    assert "2 read on their own" in factcache.summary(caches)


def test_a_cached_value_cannot_be_changed_by_its_reader(local: Any, tmp_path: Path) -> None:
    state, host = local
    factcache.install(state, [host], lambda _h: [FactRequest(Directory, {"path": str(tmp_path)})])
    value = host.get_fact(Directory, path=str(tmp_path))
    value["mode"] = 0
    assert host.get_fact(Directory, path=str(tmp_path))["mode"] != 0


def test_reads_with_their_own_global_arguments_bypass_the_cache(local: Any, tmp_path: Path) -> None:
    state, host = local
    caches = factcache.install(state, [host], lambda _h: [FactRequest(Arch)])
    host.get_fact(Arch)
    host.get_fact(Arch, _shell_executable="bash")
    host.get_fact(Arch, _shell_executable="bash")
    assert (caches[host.name].stats.hits, caches[host.name].stats.misses) == (1, 2)


def test_a_host_whose_data_cannot_list_its_facts_reads_them_on_their_own(local: Any) -> None:
    state, host = local

    def broken(_h: Host) -> list[FactRequest]:
        raise FleetError("host @local: releases_kept='x': a whole number from 2 to 100")

    caches = factcache.install(state, [host], broken)
    assert host.get_fact(Arch) == subprocess.run(["uname", "-m"], capture_output=True, text=True).stdout.strip()
    assert (caches[host.name].stats.batched, caches[host.name].stats.misses) == (0, 1)


class Meets(FactBase[str]):
    """Leaves ``mine`` in ``where`` and waits (up to ``patience`` seconds) for ``theirs``: two such facts
    answer ``met`` only if they run at the same time, ``alone`` if one ran after the other."""

    @override
    def command(self, where: str, mine: str, theirs: str, patience: int = 20) -> str:
        import shlex

        w = shlex.quote(where)
        return (
            f"touch {w}/{mine}; n=0; while [ ! -e {w}/{theirs} ] && [ $n -lt {patience * 20} ]; do "
            f"sleep 0.05; n=$((n+1)); done; if [ -e {w}/{theirs} ]; then echo met; else echo alone; fi"
        )

    @override
    def process(self, output: list[str]) -> str:
        return output[0]


def test_the_batch_runs_its_facts_side_by_side_and_answers_in_order(local: Any, tmp_path: Path) -> None:
    state, host = local
    requests = [
        FactRequest(Meets, {"where": str(tmp_path), "mine": "a", "theirs": "b", "patience": 5}),
        FactRequest(Printed, {"text": "x" * 20_000 + "\n"}),  # longer than a pipe writes whole
        FactRequest(Meets, {"where": str(tmp_path), "mine": "b", "theirs": "a", "patience": 5}),
    ]
    command = FactBatch().command([r.shell() for r in requests])
    assert command.index('cat -- "$d/0" "$d/1" "$d/2"') > command.rindex("wait")  # printed in order, after all finished
    answers = batch(state, host, requests)
    assert [answer_of(r, answers[i]) for i, r in enumerate(requests)] == ["met", ["x" * 20_000], "met"]


def test_an_empty_batch_runs_nothing(local: Any) -> None:
    state, host = local
    assert FactBatch().command([]) == ":"
    assert batch(state, host, []) == {}


def test_the_remembered_connector_arguments_follow_the_operation_and_the_call(local: Any) -> None:
    from pyinfra.api.arguments import CONNECTOR_ARGUMENT_KEYS, pop_global_arguments

    state, host = local
    cache = factcache.install(state, [host], lambda _h: [])[host.name]

    def pyinfras(kwargs: dict[str, Any]) -> str:  # what the cache keyed by before it remembered
        context = dict(host.current_op_global_arguments or {})
        context.update(kwargs)
        found, _ = pop_global_arguments(state, host, context)
        return repr(sorted({k: found.get(k) for k in CONNECTOR_ARGUMENT_KEYS if k in found}.items()))

    seen = set()
    for operation in ({}, {"_sudo": True}, {"_sudo": True, "_sudo_user": "vllm"}, {}):
        host.current_op_global_arguments = operation
        for call in ({}, {"path": "/x"}, {"_shell_executable": "bash"}, {"path": "/x", "_sudo": False}):
            own, executor = cache._executor(dict(call))
            assert executor == pyinfras(dict(call)), (operation, call)
            assert own == {k: v for k, v in call.items() if not k.startswith("_")}
            seen.add(executor)
    host.current_op_global_arguments = None
    assert len(seen) >= 4  # sudo, sudo as vllm, another shell, none: each its own key


def test_pyinfras_global_arguments_are_resolved_once(local: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Once a deploy's fact cache is installed, pyinfra's ``pop_global_arguments`` (each operation
    of each host, each ``add_deploy``) and ``_handle_fact_kwargs`` (each fact read) no longer
    resolve ``AllArguments``' annotations each time; what they get is what pyinfra computed."""
    import typing

    import pyinfra.api.arguments
    import pyinfra.api.facts
    from pyinfra.api.arguments import AllArguments, pop_global_arguments

    state, host = local
    factcache.install(state, [host], lambda _h: [])
    expected = list(typing.get_type_hints(AllArguments).items())
    calls = []

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        return typing.get_type_hints(*args, **kwargs)

    monkeypatch.setattr(pyinfra.api.arguments, "get_type_hints", counted)
    for _ in range(5):
        arguments, _found = pop_global_arguments(state, host, {"_sudo": True})
        assert arguments["_sudo"] is True
    assert calls == []
    for lookup in (pyinfra.api.arguments.all_global_arguments, pyinfra.api.facts.all_global_arguments):
        got = lookup()
        assert got == expected and got is not lookup()  # a new list each time, as pyinfra's
    assert pyinfra_get_fact(state, host, Arch) == subprocess.run(["uname", "-m"], capture_output=True, text=True,
                                                                check=True).stdout.strip()  # fmt: skip


def test_an_operations_facts_are_read_ahead_in_one_command_after_a_change(local: Any, tmp_path: Path) -> None:
    # pyinfra prepares an operation by running it up to its first command (the facts it reads
    # then are remembered); when it runs after another operation's command emptied the cache, its
    # first read brings all those facts in one command, not one round trip each
    state, host = local
    one, two = tmp_path / "one", tmp_path / "two"
    one.write_text("1\n")
    caches = factcache.install(state, [host], lambda _h: [FactRequest(Arch)])
    cache = caches[host.name]
    asked = [
        FactRequest(Sha1File, {"path": str(one)}),
        FactRequest(Sha1File, {"path": str(two)}),
        FactRequest(Arch),
        FactRequest(NeedsMissingCommand),  # no answer in a batch: read on its own, as pyinfra reads it
    ]
    commands: list[str] = []
    run = host.run_shell_command

    def counted(command: Any, *args: Any, **kwargs: Any) -> Any:
        commands.append(str(command))
        return run(command, *args, **kwargs)

    host.run_shell_command = counted
    host.current_op_hash = "op-1"
    prepared = [host.get_fact(r.fact, **r.kwargs) for r in asked]  # pyinfra preparing the operation
    assert len(commands) == 1 + 3  # the first batch (Arch), then the three others each on its own
    commands.clear()
    host.current_op_hash = "op-0"
    ok, _out = host.run_shell_command("true")  # an earlier operation's change
    state.is_executing = True
    host.current_op_hash = "op-1"
    one.write_text("changed\n")
    values = [host.get_fact(r.fact, **r.kwargs) for r in asked]
    assert ok and len(commands) == 1 + 1 + 1  # the change, the read ahead, the missing command's fact
    assert cache.stats.ahead == 1
    assert values[0] == hashlib.sha1(b"changed\n").hexdigest() and values[1:] == prepared[1:]
    # each equals the fact read on its own (which the host's shell counts as a change, as the next)
    assert values[:3] == [pyinfra_get_fact(state, host, r.fact, kwargs=dict(r.kwargs)) for r in asked[:3]]
    # a read ahead serves only until the next command: the operation's own command empties the cache
    host.run_shell_command("true")
    two.write_text("2\n")
    before = len(commands)
    assert host.get_fact(Sha1File, path=str(two)) == hashlib.sha1(b"2\n").hexdigest()  # not served stale
    assert len(commands) == before + 1  # read ahead again, with the others
    assert "1 operation(s) read their facts ahead" not in factcache.summary(caches)
    assert "2 operation(s) read their facts ahead" in factcache.summary(caches)
