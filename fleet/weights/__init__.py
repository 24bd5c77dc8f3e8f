"""Model weights where the units read them: a manifest of the source, each host's copy verified
against it, missing or damaged files sent over fleet's own SSH connection (issue 22).

* ``manifest``: every file's relative path, size and SHA-256, computed once from the source on
  the control machine and cached beside it, keyed by (path, size, mtime);
* ``verify``: pure verdicts (a host's listing against the manifest, the disk-space check, the
  transfer's rate and ETA), table-tested;
* ``copyfact``: the fact that lists a host's copy (one remote command: sizes and SHA-256);
* ``stage``: the I/O: list, decide, send (paramiko SFTP), rename into place, verify again, point
  ``refs/main`` at the snapshot.
"""
