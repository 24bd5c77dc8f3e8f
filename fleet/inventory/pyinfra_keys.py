"""The host-data keys pyinfra itself reads, taken from the installed pyinfra's own code.

An inventory is a pyinfra inventory: besides fleet's keys it holds pyinfra's (``ssh_user``,
``_sudo``...). fleet refuses any other key it does not know (a misspelt ``served_name`` must not
pass silently), so it has to know pyinfra's exactly. They are read from pyinfra at run time, not
copied, so an upgrade of pyinfra brings its new keys along:

* every operation global argument (``pyinfra.api.arguments.all_global_arguments``: ``_sudo``,
  ``_su_user``, ``_env``, ``_shell_executable``, ``_retries``, ``name``...):
  ``pop_global_arguments`` takes each one's default from the host data of that name;
* every connector's data keys (``BaseConnector.data_meta``: the ssh connector's ``ssh_hostname``,
  ``ssh_port``, ``ssh_user``, ``ssh_key``, ``ssh_strict_host_key_checking``..., the docker
  connector's ``docker_identifier``...), for each connector registered under pyinfra's entry
  point group ``pyinfra.connectors`` (``pyinfra.api.connectors.get_all_connectors``), so the
  connectors of pyinfra plugins count too;
* the two keys connectors read as attributes without declaring them: ``chroot_directory``
  (``pyinfra/connectors/chroot.py``, ``ChrootConnector.connect``) and ``docker_image``
  (``pyinfra/connectors/dockerssh.py``, ``DockerSSHConnector.connect``).
"""

from __future__ import annotations

from functools import cache
from importlib.metadata import entry_points

#: Read as ``host.data.<key>`` by pyinfra 3.10's connectors, not declared in their ``data_meta``.
ATTRIBUTE_KEYS: frozenset[str] = frozenset({"chroot_directory", "docker_image"})
CONNECTOR_GROUP = "pyinfra.connectors"


@cache
def pyinfra_keys() -> frozenset[str]:
    """Every host-data key the installed pyinfra (and its connector plugins) reads."""
    from pyinfra.api.arguments import all_global_arguments

    keys = {name for name, _type in all_global_arguments()} | ATTRIBUTE_KEYS
    # pyinfra.api.connectors.get_all_connectors, one entry point at a time: a broken third-party
    # plugin must not make every inventory unreadable (pyinfra would fail on it only when used)
    for entry in entry_points(group=CONNECTOR_GROUP):
        try:
            connector = entry.load()
        except Exception:  # its keys are unknown; pyinfra reports the plugin when it is used
            continue
        meta = getattr(connector, "data_meta", None)
        if isinstance(meta, dict):
            keys.update(k for k in meta if isinstance(k, str))
    return frozenset(keys)
