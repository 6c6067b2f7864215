"""Opening shards wherever they are: local paths, `pipe:` commands, http(s) and fsspec's schemes (s3, gs, ...).

http and https go through the standard library, so they need nothing installed; other schemes go
through fsspec with the matching package (s3fs for s3://, gcsfs for gs://). Credentials are those
libraries' own (environment, instance roles, config files), never sdtrain's config.
"""

from __future__ import annotations

import json
import subprocess
import urllib.error
import urllib.request
from typing import IO, Any
from urllib.parse import urlparse

from sdtrain.errors import UserError

REMOTE_PREFIXES = ("pipe:", "http://", "https://", "s3://", "gs://", "gcs://", "az://", "abfs://", "hf://")
TIMEOUT_S = 60


def is_remote(url: str) -> bool:
    """Anything but a local path: `pipe:` or a URL scheme (http, s3, gs, fsspec's memory, ...)."""
    return url.startswith(REMOTE_PREFIXES) or ("://" in url and not url.startswith("file://"))


def open_url(url: str) -> IO[bytes]:
    """A readable binary stream of `url`; OSError when it cannot be opened."""
    if url.startswith("pipe:"):
        process = subprocess.Popen(url[5:], shell=True, stdout=subprocess.PIPE)  # noqa: S602 - the user's command
        assert process.stdout is not None
        return process.stdout
    scheme = urlparse(url).scheme
    if scheme in ("http", "https"):
        try:
            return urllib.request.urlopen(url, timeout=TIMEOUT_S)  # noqa: S310 - the user's shard URL
        except urllib.error.URLError as exc:
            raise OSError(f"{url}: {getattr(exc, 'reason', exc)}") from exc
    if scheme in ("", "file"):
        return open(urlparse(url).path if scheme else url, "rb")
    try:
        import fsspec
    except ImportError as exc:
        raise UserError(f"{url}: reading {scheme}:// needs fsspec and its {scheme} package (pip install fsspec)") \
            from exc
    try:
        return fsspec.open(url, "rb").open()
    except ImportError as exc:
        raise UserError(f"{url}: fsspec needs a package for {scheme}:// ({exc}); install it, e.g. s3fs") from exc


def read_json(url: str) -> Any | None:
    """A small remote JSON document, or None when it does not exist."""
    try:
        with open_url(url) as stream:
            return json.loads(stream.read())
    except FileNotFoundError:
        return None
    except OSError as exc:
        if "404" in str(exc) or "Not Found" in str(exc):
            return None
        raise UserError(f"{url}: cannot read ({exc}); check the address and your access") from exc
    except ValueError as exc:
        raise UserError(f"{url}: not valid JSON ({exc})") from exc
