"""Facts read once per host and reused until the host runs a command: a deploy's fact cache.

pyinfra 3 reads every fact anew each time an operation asks (``pyinfra.api.facts.get_fact``),
and runs each operation's generator twice: once while preparing (to learn whether it would
change anything) and again while executing. On a host where nothing changes, a deploy so reads
each fact two or three times, each read one SSH round trip through ``sudo``.

:func:`install` puts a cache in front of ``get_fact`` on each pyinfra ``Host`` of a deploy:

* the first fact a host is asked for brings, in one command (:class:`fleet.facts.batch.FactBatch`),
  every fact a list of requests names (the facts the deploy is known to read), each answer
  processed by its own fact class;
* a fact read (from the batch or on its own) is reused while the host has run no command since;
  any command, upload or download on the host (an operation's change) empties its cache, so a
  fact read after a change is read from the host again.

The operations are unchanged: they still call ``host.get_fact`` and decide from what it returns.
A fact the batch does not cover, or whose batch answer pyinfra would treat as more than a value
(a failed command, a missing command, output the fact cannot process), is read on its own by
pyinfra, with pyinfra's own errors. The cache keys a read by the fact, its arguments as pyinfra
binds them, and the connector arguments (``sudo``, user, shell...) it would run with.
"""

from __future__ import annotations

import copy
import functools
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import pyinfra.api.arguments
import pyinfra.api.facts
from pyinfra.api.arguments import CONNECTOR_ARGUMENT_KEYS, all_argument_meta, pop_global_arguments
from pyinfra.api.facts import FactBase, ShortFactBase
from pyinfra.api.facts import get_fact as pyinfra_get_fact
from pyinfra.api.host import Host
from pyinfra.api.state import State

from fleet.errors import FleetError
from fleet.facts.batch import NO_ANSWER, FactBatch, FactRequest, answer_of

logger = logging.getLogger(__name__)

#: The facts a host's deploy reads, from the host (its name and data).
Requests = Callable[[Host], list[FactRequest]]
Key = tuple[type[FactBase[Any]], str, str]


@dataclass
class Stats:
    batched: int = 0  #: facts brought by a batch (the first one, and each operation's read ahead)
    hits: int = 0  #: reads answered from the cache
    misses: int = 0  #: reads that went to the host on their own
    invalidations: int = 0  #: times a command emptied the cache
    ahead: int = 0  #: batches of an operation's facts read ahead (see FactCache.get_fact)


@dataclass
class FactCache:
    state: State
    host: Host
    requests: Requests
    stats: Stats = field(default_factory=Stats)
    _values: dict[Key, Any] = field(default_factory=dict)
    _executors: dict[str, str] = field(default_factory=dict)  #: see _executor
    _prefetched: bool = False
    #: per operation (its hash), the facts it read while pyinfra prepared it: before its first command
    _op_reads: dict[str, dict[Key, FactRequest]] = field(default_factory=dict)
    _reading: bool = False  #: a fact command is running (not an operation's command)

    def _executor(self, kwargs: dict[str, Any]) -> tuple[dict[str, Any], str]:
        """(the fact's own keyword arguments, the connector arguments it runs with), as pyinfra's
        ``get_fact`` splits them (the operation's global arguments, then the call's).

        pyinfra's ``pop_global_arguments`` resolves all 32 global arguments through
        ``typing.get_type_hints`` on every call: a no-change deploy of 4 hosts asked it 368 times,
        a fifth of the fleet process's CPU. Its answer depends only on what it is given (the
        operation's and the deploy's global arguments, those among the call's) besides the host's
        data and the config, which do not change during a run: so it is asked once per distinct
        set of those and remembered (``_executors``)."""
        given = {k: v for k, v in kwargs.items() if k in all_argument_meta}
        own = {k: v for k, v in kwargs.items() if k not in given}
        asked = repr((
            sorted((self.host.current_op_global_arguments or {}).items()),
            sorted((self.host.current_deploy_kwargs or {}).items()),
            sorted(given.items()),
        ))  # fmt: skip
        executor = self._executors.get(asked)
        if executor is None:
            context = dict(self.host.current_op_global_arguments or {})
            context.update(kwargs)
            global_arguments, _found = pop_global_arguments(self.state, self.host, context)
            executor = repr(
                sorted((k, global_arguments.get(k)) for k in CONNECTOR_ARGUMENT_KEYS if k in global_arguments)
            )
            self._executors[asked] = executor
        return own, executor

    def _key(self, fact: type[FactBase[Any]], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Key | None:
        """The read's key, or None to leave it to pyinfra (positional arguments, per-call global
        arguments such as ``_sudo=False``, arguments the fact does not take)."""
        if args:
            return None
        own, executor = self._executor(kwargs)
        if len(own) != len(kwargs):
            return None
        try:
            bound = FactRequest(fact, own).arguments()
        except TypeError:
            return None  # pyinfra raises the right error
        return (fact, repr(sorted(bound.items())), executor)

    def _prefetch(self) -> None:
        self._prefetched = True
        try:
            requests = self.requests(self.host)
        except FleetError as exc:  # the host's data: the operation that reads it reports it, in its place
            logger.debug("%s: no fact batch (%s)", self.host.name, exc)
            return
        wanted = [(key, r) for r in requests if (key := self._key(r.fact, (), dict(r.kwargs))) is not None]
        if wanted:
            self._bring(wanted)

    def get_fact(self, fact: type[FactBase[Any]], *args: Any, **kwargs: Any) -> Any:
        """The fact's value: from the cache, else read ahead with the operation's other facts, else
        on its own.

        Reading ahead: pyinfra prepares an operation by running its generator up to its first
        command; the facts it read then (remembered per operation) are those it reads before its
        first command when it runs. When it runs after another operation's command emptied the
        cache, its first read that misses brings every one of those not held in one ``FactBatch``
        command, instead of one round trip each. Nothing stale can be served: any command the
        operation then runs empties the cache as before."""
        if issubclass(fact, ShortFactBase):
            return pyinfra_get_fact(self.state, self.host, fact, args=args, kwargs=kwargs)
        if not self._prefetched:
            self._prefetch()
        key = self._key(fact, args, kwargs)
        op = self.host.current_op_hash
        if key is not None and op is not None and not self.state.is_executing:
            self._op_reads.setdefault(op, {}).setdefault(key, FactRequest(fact, kwargs))
        if key is not None and key not in self._values and op is not None and self.state.is_executing:
            ahead = [(k, r) for k, r in self._op_reads.get(op, {}).items() if k not in self._values]
            if len(ahead) > 1 and any(k == key for k, _r in ahead):
                self.stats.ahead += 1
                self._bring(ahead)
        if key is not None and key in self._values:
            self.stats.hits += 1
            return copy.deepcopy(self._values[key])
        self.stats.misses += 1
        logger.debug("%s: fact %s %s read on its own (not in the batch)", self.host.name, fact.__name__, kwargs)
        self._reading = True
        try:
            value = pyinfra_get_fact(self.state, self.host, fact, args=args, kwargs=kwargs)
        finally:
            self._reading = False
        if key is not None and self.host not in self.state.failed_hosts:
            self._values[key] = copy.deepcopy(value)
        return value

    def _bring(self, wanted: list[tuple[Key, FactRequest]]) -> None:
        """Read ``wanted`` in one ``FactBatch`` command; keep the answers pyinfra would give as values."""
        self._reading = True
        try:
            answers = pyinfra_get_fact(
                self.state, self.host, FactBatch, kwargs={"commands": [r.shell() for _k, r in wanted]},
                apply_failed_hosts=False,
            )  # fmt: skip
        finally:
            self._reading = False
        for i, (key, request) in enumerate(wanted):
            value = answer_of(request, answers.get(i))
            if value is not NO_ANSWER:
                self._values[key] = value
                self.stats.batched += 1

    def changed(self) -> None:
        """The host ran something: what was read may be out of date."""
        if self._values:
            self.stats.invalidations += 1
        self._values.clear()

    def guard(self, method: Callable[..., Any]) -> Callable[..., Any]:
        """``method`` (a command, an upload, a download on the host), emptying the cache first
        unless a fact is being read."""

        def guarded(*args: Any, **kwargs: Any) -> Any:
            if not self._reading:
                self.changed()
            return method(*args, **kwargs)

        return guarded


_GLOBAL_ARGUMENTS = pyinfra.api.arguments.all_global_arguments


@functools.cache
def _global_arguments() -> tuple[tuple[str, type], ...]:
    return tuple(_GLOBAL_ARGUMENTS())


def global_arguments() -> list[tuple[str, type]]:
    """pyinfra's ``all_global_arguments`` (``pyinfra/api/arguments.py``), its answer computed once:
    ``typing.get_type_hints(AllArguments)``, the global arguments of a class pyinfra defines once.

    pyinfra asks it on every ``pop_global_arguments`` (each operation of each host while the
    deploy prepares them, each ``add_deploy``) and in ``_handle_fact_kwargs`` (each fact read):
    ~190 times in a no-change deploy of 4 hosts, each resolving the 32 arguments' annotations
    again (0.2 ms each on an idle machine). A new list each time, as pyinfra's own."""
    return list(_global_arguments())


def remember_global_arguments() -> None:
    """Put :func:`global_arguments` in place of pyinfra's ``all_global_arguments`` where pyinfra
    looks it up (``pyinfra.api.arguments``, and ``pyinfra.api.facts``, which imported it by name)."""
    pyinfra.api.arguments.all_global_arguments = global_arguments
    pyinfra.api.facts.all_global_arguments = global_arguments  # type: ignore[attr-defined]


def install(state: State, hosts: Iterable[Host], requests: Requests) -> dict[str, FactCache]:
    """Put a :class:`FactCache` in front of each host's ``get_fact`` (for this ``state`` only:
    pyinfra's ``Host`` objects belong to one ``State``), and :func:`remember_global_arguments`.
    Returns the caches by host name."""
    remember_global_arguments()
    caches: dict[str, FactCache] = {}
    for host in hosts:
        cache = FactCache(state, host, requests)
        for name in ("run_shell_command", "put_file", "get_file"):
            setattr(host, name, cache.guard(getattr(host, name)))
        setattr(host, "get_fact", cache.get_fact)  # noqa: B010 (a method of this one object)
        caches[host.name] = cache
    return caches


def summary(caches: dict[str, FactCache]) -> str:
    """One line for the log: how the facts were read."""
    total = Stats()
    for c in caches.values():
        total.batched += c.stats.batched
        total.hits += c.stats.hits
        total.misses += c.stats.misses
        total.invalidations += c.stats.invalidations
        total.ahead += c.stats.ahead
    return (
        f"facts on {len(caches)} host(s): {total.batched} batched, {total.hits} reads from the cache, "
        f"{total.misses} read on their own, cache emptied {total.invalidations} time(s) by a change, "
        f"{total.ahead} operation(s) read their facts ahead in one command"
    )
