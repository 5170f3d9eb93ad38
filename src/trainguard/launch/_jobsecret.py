"""The job secret of a launched job: where it comes from, and that a job on several hosts has one.

Every key of a job carries its secret (the Wrapper's keys and the launcher's own: heartbeats,
lost marks, rank lists, exit marks, escalation, vacancies, the published store address), so
that a process that reaches the stores but does not know the secret can neither read nor forge
them. On one host the workers can make and share one themselves (a private file); on several
hosts it must come from outside the stores. :func:`establish`, called by ``trainguard launch``
before anything connects:

- ``--tg-secret-file PATH`` (a file readable by this user only: mode 0600 or stricter, the same
  file on every node, e.g. on a shared home directory): its first line is the secret;
- else ``TRAINGUARD_JOB_SECRET`` (the same value on every node; ``examples/slurm/train.sbatch``
  makes one per job);
- else, for a job whose rendezvous endpoint is not a loopback address (several hosts), the
  launcher refuses to start with an error naming both, unless ``--tg-insecure`` is given: the
  workers then hand a secret over in the store (``TRAINGUARD_INSECURE=1``), which keeps out
  only blind writes.

The secret reaches the agent's own keys and its workers through ``TRAINGUARD_JOB_SECRET`` in
the agent's environment, which torch copies into every worker's.
"""

from __future__ import annotations

import logging
import os
import stat

from trainguard import _env
from trainguard.coord import is_loopback
from trainguard.errors import ConfigError

__all__ = ["establish", "several_hosts"]

logger = logging.getLogger(__name__)


def several_hosts(endpoint: str) -> bool:
    """Whether a job with this rendezvous endpoint (``host:port``) can span several hosts."""
    host = endpoint.rsplit(":", 1)[0].strip("[]") if endpoint else ""
    return bool(host) and not is_loopback(host)


def _read(path: str) -> str:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        raise ConfigError(f"--tg-secret-file {path}: cannot open it ({exc})") from None
    with os.fdopen(fd) as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise ConfigError(f"--tg-secret-file {path} is not a regular file")
        if info.st_mode & 0o077:
            raise ConfigError(
                f"--tg-secret-file {path} can be read by other users (mode "
                f"{stat.S_IMODE(info.st_mode):o}): `chmod 600 {path}`"
            )
        if info.st_uid != os.geteuid():
            raise ConfigError(f"--tg-secret-file {path} belongs to another user")
        first = f.read(4096).splitlines()
    secret = first[0].strip() if first else ""
    try:
        return _env._check_secret(secret)
    except ConfigError:
        raise ConfigError(
            f"--tg-secret-file {path} must hold the secret on its first line: 16+ of "
            "A-Z a-z 0-9 _ -, e.g. `openssl rand -hex 16 > FILE`"
        ) from None


def establish(*, endpoint: str, secret_file: str | None, insecure: bool) -> str:
    """Settle this launcher's job secret (see the module docstring); returns where it came
    from: ``"file"``, ``"env"``, ``"none"`` (one host: the workers make one) or ``"insecure"``.
    Raises :class:`ConfigError` naming the fix."""
    if secret_file:
        os.environ["TRAINGUARD_JOB_SECRET"] = _read(secret_file)
        return "file"
    if _env.settings().job_secret is not None:
        return "env"
    if not several_hosts(endpoint):
        return "none"
    if not insecure:
        raise ConfigError(
            f"this job can span several hosts (rendezvous endpoint {endpoint}) and has no job "
            "secret: anyone who reaches its stores could read and forge its keys. Set "
            "TRAINGUARD_JOB_SECRET to the same random value on every node (`openssl rand -hex "
            "16`; examples/slurm/train.sbatch makes one per job), or pass --tg-secret-file "
            "PATH (a mode-600 file on a shared path), or --tg-insecure to run without it"
        )
    logger.warning(
        "--tg-insecure: this job on several hosts runs without a job secret; any host that "
        "reaches its stores can read and forge its keys"
    )
    os.environ["TRAINGUARD_INSECURE"] = "1"
    return "insecure"
