"""HAProxy's runtime API answers (recorded from Debian's haproxy 2.6.12 in
``tests/fixtures/haproxy/``) and fleet's configuration for it, as pure functions."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleet.errors import RenderError
from fleet.inventory.spec import BalancerSpec
from fleet.lb.config import Backend, BalancerConfig, Server, group_balancers, render_config, systemd_dropin
from fleet.lb.runtime import (
    AdminState,
    AnswerError,
    ServerState,
    ServerView,
    check_set_answer,
    parse_servers_state,
    parse_snapshot,
    parse_stat,
    set_state_command,
    split_answers,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "haproxy"


def test_a_recorded_snapshot() -> None:
    views = parse_snapshot((FIXTURES / "snapshot-2.6.txt").read_text().lstrip("\n"))
    b = "meta-llama_Llama"
    assert sorted(views) == [(b, "lab-h1:vllm-0"), (b, "lab-h1:vllm-1"), (b, "lab-h2:vllm-0")]
    ready, drained, new = views[(b, "lab-h1:vllm-0")], views[(b, "lab-h1:vllm-1")], views[(b, "lab-h2:vllm-0")]
    # written `disabled` (0x04 stays), set ready at runtime: ready, its checks fail: DOWN
    assert (ready.admin, ready.view, ready.status, ready.check) == (AdminState.READY, "DOWN", "DOWN", "L4CON")
    assert (drained.admin, drained.view) == (AdminState.DRAIN, "DOWN")
    assert (new.admin, new.view, new.status) == (AdminState.DRAIN, "DRAIN", "DRAIN 1/3")
    assert all(v.sessions == 0 and v.queued == 0 for v in views.values())


@pytest.mark.parametrize(
    ("mask", "admin"),
    [(0, "ready"), (4, "ready"), (5, "maint"), (1, "maint"), (8, "drain"), (12, "drain"), (9, "maint"),
     (0x10, "drain"), (0x02, "maint"), (0x20, "maint")],
)  # fmt: skip
def test_admin_state_from_the_mask(mask: int, admin: str) -> None:
    assert ServerState("b", "s", "", 2, mask).admin.value == admin


@pytest.mark.parametrize(
    ("status", "view"),
    [("UP", "UP"), ("UP 1/3", "UP"), ("DOWN 1/2", "DOWN"), ("DRAIN", "DRAIN"), ("MAINT", "MAINT"),
     ("MAINT (resolution)", "MAINT"), ("no check", "UP"), ("NOLB", "DRAIN"), ("", "?")],
)  # fmt: skip
def test_view_for_people(status: str, view: str) -> None:
    assert ServerView("b", "s", AdminState.READY, status, 0, 0).view == view


def test_stat_csv_is_read_by_field_name_with_quoted_fields() -> None:
    text = (
        "# pxname,svname,qcur,qmax,scur,status,type,check_status,extra\n"
        'be,"odd,name",2,0,3,UP,2,* L7OK,"x ""quoted"""\n'
        "be,BACKEND,0,0,3,UP,1,,\n"
        "fe,FRONTEND,,,0,OPEN,0,,\n"
    )
    (row,) = parse_stat(text)
    assert (row.backend, row.server, row.queued, row.sessions, row.status, row.check) == (
        "be", "odd,name", 2, 3, "UP", "L7OK",
    )  # fmt: skip
    with pytest.raises(AnswerError, match="no CSV header"):
        parse_stat("Unknown command.\n")


def test_servers_state_errors() -> None:
    assert parse_servers_state("") == []
    with pytest.raises(AnswerError, match="Can't find backend"):
        parse_servers_state("Can't find backend.\n")
    with pytest.raises(AnswerError, match="format version 2"):
        parse_servers_state("2\n# be_id\n")


def test_answers_must_be_complete() -> None:
    assert split_answers("a\nb\n\nc\n\n", 2) == ["a\nb", "c"]
    with pytest.raises(AnswerError, match="cut short"):
        split_answers("1\n# x\n1 b 1 s\n\n# pxname\nb,s", 2)


def test_set_commands_and_their_answers() -> None:
    assert set_state_command("chat", "h1:vllm-0", AdminState.DRAIN) == "set server chat/h1:vllm-0 state drain"
    for bad in ("a;b", "a b", "a\nb", "a/b", ""):
        with pytest.raises(ValueError):
            set_state_command(bad, "s", AdminState.READY)
    check_set_answer("set ...", "\n")
    with pytest.raises(AnswerError, match=r"refused `set x`: No such server\."):
        check_set_answer("set x", "No such server.\n\n")


LB = BalancerSpec("haproxy", "local", "127.0.0.1:8080", "/run/fleet/admin.sock", "/etc/fleet/haproxy.cfg", "chat")


def test_config_for_a_local_balancer() -> None:
    servers = [Server("h1", "vllm-0", "10.0.0.1", 8000), Server("h1", "vllm-1", "10.0.0.1", 8001),
               Server("h2", "vllm-0", "fd00::2", 8000)]  # fmt: skip
    (config,) = group_balancers([(LB, s) for s in servers])
    text = render_config(config, "/inv/prod.py")
    lines = [line.strip() for line in text.splitlines()]
    assert "stats socket /run/fleet/admin.sock mode 600 level admin" in lines
    assert "server-state-file /etc/fleet/haproxy.cfg.state" in lines
    assert "load-server-state-from-file global" in lines
    assert "retry-on conn-failure empty-response" in lines
    assert "option httpchk GET /health" in lines and "http-check expect status 200" in lines
    assert "default-server check inter 2s fall 2 rise 2 slowstart 30s" in lines
    assert "bind 127.0.0.1:8080" in lines and "default_backend chat" in lines
    assert [line for line in lines if line.startswith("server ")] == [
        "server h1:vllm-0 10.0.0.1:8000 disabled",
        "server h1:vllm-1 10.0.0.1:8001 disabled",
        "server h2:vllm-0 [fd00::2]:8000 disabled",
    ]
    assert "chroot" not in text and "user haproxy" not in text  # a process of ours, not Debian's service
    assert config.servers == [("chat", "h1:vllm-0"), ("chat", "h1:vllm-1"), ("chat", "h2:vllm-0")]


def test_config_for_a_balancer_host_and_its_reload_dropin() -> None:
    spec = BalancerSpec("haproxy", "lb1", "0.0.0.0:80", "/run/haproxy/admin.sock", "/etc/haproxy/haproxy.cfg", "m")
    config = BalancerConfig(spec, (Backend("m", "0.0.0.0:80", (Server("h", "vllm-0", "h", 8000),)),))
    text = render_config(config, "inv.py")
    assert "chroot /var/lib/haproxy" in text and "stats socket /run/haproxy/admin.sock mode 660 level admin" in text
    assert "server-state-file /var/lib/haproxy/server-state" in text
    dropin = systemd_dropin(spec.admin_socket, config.state_file, spec.config)
    assert dropin.splitlines()[2:] == [
        "Environment=CONFIG=/etc/haproxy/haproxy.cfg",
        "ExecReload=",
        "ExecReload=/usr/sbin/haproxy -Ws -f $CONFIG -c -q $EXTRAOPTS",
        "ExecReload=/bin/sh -c \"echo 'show servers state' | socat -t 5 STDIO UNIX-CONNECT:/run/haproxy/admin.sock"
        " > /var/lib/haproxy/server-state.tmp && mv -f /var/lib/haproxy/server-state.tmp"
        ' /var/lib/haproxy/server-state || true"',
        "ExecReload=/bin/kill -USR2 $MAINPID",
    ]


def test_a_word_that_would_change_a_config_line_is_refused() -> None:
    config = BalancerConfig(LB, (Backend("chat", "127.0.0.1:8080", (Server("h", "vllm-0", "a b", 1),)),))
    with pytest.raises(RenderError, match="one word"):
        render_config(config, "inv.py")


def test_two_backends_on_one_balancer_and_two_balancers() -> None:
    other = BalancerSpec("haproxy", "local", "127.0.0.1:8081", LB.admin_socket, LB.config, "code")
    far = BalancerSpec("haproxy", "lb1", "0.0.0.0:80", "/run/haproxy/admin.sock", "/etc/haproxy/haproxy.cfg", "m")
    configs = group_balancers([(LB, Server("a", "vllm-0", "a", 1)), (other, Server("b", "vllm-0", "b", 1)),
                               (far, Server("c", "vllm-0", "c", 1)), (LB, Server("a", "vllm-1", "a", 2))])  # fmt: skip
    assert [(c.spec.on, [(b.name, b.bind, [s.name for s in b.servers]) for b in c.backends]) for c in configs] == [
        ("local", [("chat", "127.0.0.1:8080", ["a:vllm-0", "a:vllm-1"]), ("code", "127.0.0.1:8081", ["b:vllm-0"])]),
        ("lb1", [("m", "0.0.0.0:80", ["c:vllm-0"])]),
    ]
