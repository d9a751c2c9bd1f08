"""Fetch one model or dataset to its destination, verified and resumable; where a mirror serves it.

A source is a URI, and it lands as a file or as a folder at its destination:

  https://HOST/PATH      a file (an interrupted download resumes with an HTTP Range request)
  https://HOST/PATH/     a folder, fetched file by file through its .areal-kit-manifest.json
  file:///PATH           a file or a folder, copied
  hf://ORG/NAME, hf://datasets/ORG/NAME, tiny://toy, toy://sums/FILE
                         need libraries of the runtime image: cluster/fetch.py passes their filler

Each destination keeps a record of what it holds, which `check` reads: a folder its
.areal-kit-manifest.json ({"uri", "files": {relpath: [size, sha256]}}), a file the hidden
sibling .NAME.areal-kit.json ({"uri", "size", "sha256", "rows"}). A download goes to the hidden
sibling .NAME.partial, is verified (the size the server announced, and the sha256 and row count
where known), and only then renamed to the destination: a failed or interrupted fetch never
leaves a half file there, and the next fetch resumes the partial one.

A mirror serves every source under its origin's layout, so copying fetched folders makes one:

  https://HOST/PATH          -> MIRROR/HOST/PATH
  hf://ORG/NAME              -> MIRROR/huggingface.co/ORG/NAME/
  hf://datasets/ORG/NAME     -> MIRROR/huggingface.co/datasets/ORG/NAME/
  tiny://toy?seed=1          -> MIRROR/tiny/toy-seed1/           (generated sources: the query's
  toy://sums/F?n=8&seed=1    -> MIRROR/toy/sums-n8-seed1/F        pairs join the name)

    a = Asset("aime24", "https://raw.githubusercontent.com/.../aime24/test.jsonl", "/storage/x/test.jsonl", rows=30)
    fetch(a, mirror="http://10.0.0.1:8000")   # "fetched aime24 /storage/x/test.jsonl (30 rows, ...)"
"""

from __future__ import annotations

import functools
import hashlib
import http.client
import json
import os
import shutil
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MANIFEST = ".areal-kit-manifest.json"
GENERATED = ("tiny://", "toy://")
SCHEMES = ("hf://", "https://", "http://", "file://", *GENERATED)
HTTP_TIMEOUT = 60.0


class FetchError(Exception):
    """A source that could not be fetched or failed verification; status is the HTTP code, if any."""

    def __init__(self, message: str, status: int = 0):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Asset:
    """One source and the path it lands at. sha256 and rows, where given, are checked on arrival."""

    name: str
    uri: str  # the origin; a #sha256=HEX fragment is the same as sha256
    dest: str
    sha256: str = ""
    rows: int = 0

    @property
    def base(self) -> str:
        return split_uri(self.uri)[0]

    @property
    def want_sha(self) -> str:
        return split_uri(self.uri)[1] or self.sha256


def split_uri(uri: str) -> tuple[str, str]:
    """"https://x/f#sha256=HEX" -> ("https://x/f", "HEX"); no fragment -> (uri, "")."""
    base, _, frag = uri.partition("#")
    return base, frag.removeprefix("sha256=") if frag.startswith("sha256=") else ""


def is_folder(uri: str) -> bool | None:
    """Whether a source is a folder; None for file:// without a trailing slash (the head's path decides)."""
    base = split_uri(uri)[0]
    if base.startswith(("hf://", "tiny://")) or base.endswith("/"):
        return True
    return None if base.startswith("file://") else False


def mirror_url(uri: str, mirror: str) -> str:
    """Where a mirror serves a source (the origin itself without a mirror, and for file://)."""
    base = split_uri(uri)[0]
    if not mirror or base.startswith("file://"):
        return base
    root = mirror.rstrip("/")
    scheme, rest = base.split("://", 1)
    if scheme in ("http", "https"):
        return f"{root}/{rest}"
    if scheme == "hf":
        return f"{root}/huggingface.co/{rest.strip('/')}/"
    parts = urllib.parse.urlsplit(base)
    name = parts.netloc + "".join(f"-{k}{v}" for k, v in urllib.parse.parse_qsl(parts.query))
    url = f"{root}/{scheme}/{name}{parts.path}"
    return url.rstrip("/") + "/" if is_folder(base) else url


def record_path(dest: Path) -> Path:
    return dest.with_name(f".{dest.name}.areal-kit.json")


def partial_path(dest: Path) -> Path:
    return dest.with_name(f".{dest.name}.partial")


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def count_rows(path: Path) -> int:
    with open(path, "rb") as f:
        return sum(1 for line in f if line.strip())


def manifest_of(root: Path) -> dict[str, list]:
    """relpath -> [size, sha256] of every file under root (the hub client's .cache left out)."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.name != MANIFEST and ".cache" not in p.relative_to(root).parts:
            out[str(p.relative_to(root))] = [p.stat().st_size, sha256(p)]
    return out


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def check(a: Asset, verify: bool = False) -> tuple[bool, str]:
    """(complete, why): whether a.dest holds a.uri whole; sizes only, unless verify (every sha256)."""
    dest = Path(a.dest)
    if (dest / MANIFEST).is_file():
        data = _read_json(dest / MANIFEST)
        if data.get("uri") != a.base:
            return False, f"{dest} holds {data.get('uri')}, not {a.base}"
        for rel, (size, digest) in data.get("files", {}).items():
            p = dest / rel
            if not p.is_file() or p.stat().st_size != size:
                return False, f"{p} missing or wrong size"
            if verify and sha256(p) != digest:
                return False, f"{p} checksum mismatch"
        return True, f"{dest}: {len(data.get('files', {}))} files complete"
    rec = _read_json(record_path(dest))
    if not rec:
        return False, f"{dest}: not fetched yet"
    if rec.get("uri") != a.base:
        return False, f"{dest} holds {rec.get('uri')}, not {a.base}"
    if not dest.is_file() or dest.stat().st_size != rec.get("size"):
        return False, f"{dest} missing or wrong size"
    if (a.want_sha and rec.get("sha256") != a.want_sha) or (a.rows and rec.get("rows") != a.rows):
        return False, f"{dest} was fetched with another sha256 or row count than expected"
    if verify and sha256(dest) != rec.get("sha256"):
        return False, f"{dest} checksum mismatch"
    return True, f"{dest}: complete"


KEPT = "there already, not fetched by areal-kit: kept"


def held(dest: Path) -> str:
    """The source areal-kit recorded fetching to dest ("" where it recorded none)."""
    rec = _read_json(dest / MANIFEST) if (dest / MANIFEST).is_file() else _read_json(record_path(dest))
    return str(rec.get("uri") or "")


def _refuse_other(a: Asset, dest: Path) -> None:
    """dest holding what areal-kit fetched from another source is never replaced: a FetchError."""
    other = held(dest)
    if other and other != a.base and (dest.exists() or (dest / MANIFEST).is_file()):
        raise FetchError(f"{a.name}: {dest} holds {other} (fetched by areal-kit), not {a.base}: refused, nothing "
                         f"removed; name another path for {a.base}, or remove {dest} yourself")


def _foreign(dest: Path) -> bool:
    """Whether dest holds what someone put there by hand: it is never overwritten, nor removed."""
    if (dest / MANIFEST).is_file() or record_path(dest).is_file():
        return False
    return dest.is_file() or (dest.is_dir() and any(dest.iterdir()))


def _verified(path: Path, a: Asset, size: int = -1) -> dict:
    """The record of a downloaded file, after checking it; FetchError on the first mismatch."""
    got = path.stat().st_size
    if size >= 0 and got != size:
        raise FetchError(f"{a.name}: {a.base} gave {got} bytes, the server announced {size}")
    digest = sha256(path)
    if a.want_sha and digest != a.want_sha:
        raise FetchError(f"{a.name}: checksum mismatch for {a.base}: expected sha256 {a.want_sha}, got {digest}")
    rows = count_rows(path) if a.rows else 0
    if a.rows and rows != a.rows:
        raise FetchError(f"{a.name}: {a.base} has {rows} rows, expected {a.rows}")
    return {"uri": a.base, "size": got, "sha256": digest, **({"rows": rows} if a.rows else {})}


def fetch_file(a: Asset, fill: Callable[[Path], int]) -> str:
    """a.dest as a file: fill(partial) writes it and returns the size it should have (-1: unknown)."""
    dest = Path(a.dest)
    if dest.is_dir():
        raise FetchError(f"{a.name}: {dest} is a folder, and {a.base} a file; remove it or name another dest")
    dest.parent.mkdir(parents=True, exist_ok=True)
    _refuse_other(a, dest)
    if _foreign(dest):
        if not (a.want_sha or a.rows):
            return f"present {a.name} {dest} ({KEPT}; {a.base} not fetched)"
        try:
            rec = _verified(dest, a)
        except FetchError as e:
            raise FetchError(f"{dest} was there already, not fetched by areal-kit, and {e}; remove it to "
                             f"fetch {a.base}") from None
        _write_json(record_path(dest), rec)
        return f"present {a.name} {dest} ({KEPT}, verified)"
    part = partial_path(dest)
    size = fill(part)
    try:
        rec = _verified(part, a, size)
    except FetchError:
        part.unlink(missing_ok=True)  # the next fetch starts over, never from a bad partial
        raise
    os.replace(part, dest)
    _write_json(record_path(dest), rec)
    rows = f"{rec['rows']} rows, " if a.rows else ""
    return f"fetched {a.name} {dest} ({rows}{rec['size']} bytes)"


def fetch_folder(a: Asset, fill: Callable[[Path], dict | None]) -> str:
    """a.dest as a folder: fill(partial folder) writes it and returns its files' [size, sha256] when
    it verified each (None: computed here)."""
    dest = Path(a.dest)
    if a.want_sha:
        raise FetchError(f"{a.name}: a sha256 checks a single file, and {a.base} is a folder")
    if dest.is_file():
        raise FetchError(f"{a.name}: {dest} is a file ({held(dest) or 'not fetched by areal-kit'}), and {a.base} "
                         "a folder: refused, nothing removed; name another path, or remove it yourself")
    _refuse_other(a, dest)
    if _foreign(dest):
        return f"present {a.name} {dest} ({KEPT}; {a.base} not fetched)"
    tmp = partial_path(dest)
    if tmp.exists() and not tmp.is_dir():
        tmp.unlink()
    tmp.mkdir(parents=True, exist_ok=True)  # kept from an interrupted fetch: the filler resumes it
    try:
        got = fill(tmp)
        files = got if isinstance(got, dict) and got else manifest_of(tmp)
    except BaseException:
        if not any(tmp.iterdir()):
            tmp.rmdir()  # nothing to resume
        raise
    if dest.is_dir():  # the same source fetched before, incomplete now: its files replaced, no other touched
        for rel in files:
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            os.replace(tmp / rel, dest / rel)
        _write_json(dest / MANIFEST, {"uri": a.base, "files": files})
        shutil.rmtree(tmp)
    else:
        (tmp / MANIFEST).write_text(json.dumps({"uri": a.base, "files": files}, indent=1))
        os.rename(tmp, dest)
    return f"fetched {a.name} {dest} ({len(files)} files, {sum(s for s, _ in files.values())} bytes)"


def _open(url: str, offset: int = 0) -> http.client.HTTPResponse:  # http(s) only
    headers = {"User-Agent": "areal-kit"}
    if offset:
        headers["Range"] = f"bytes={offset}-"
    token = os.environ.get("HF_TOKEN")
    if token and urllib.parse.urlsplit(url).hostname in ("huggingface.co", "hf.co"):
        headers["Authorization"] = f"Bearer {token}"  # gated repositories; never sent to a mirror
    try:
        return urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=HTTP_TIMEOUT)
    except urllib.error.HTTPError as e:
        raise FetchError(f"{url}: HTTP {e.code} {e.reason}", e.code) from None
    except (urllib.error.URLError, OSError) as e:
        raise FetchError(f"{url} is unreachable ({getattr(e, 'reason', e)})") from None


def http_file(url: str, part: Path) -> int:
    """Download url into part, resuming what an interrupted download left; the full size announced."""
    have = part.stat().st_size if part.is_file() else 0
    try:
        r = _open(url, have)
    except FetchError as e:
        if e.status != 416 or not have:
            raise
        part.unlink()  # longer than the file: not a prefix of it, so start over
        have, r = 0, _open(url)
    with r:
        resumed = have and r.status == 206
        total = r.headers.get("Content-Range", "").rpartition("/")[2] if resumed else r.headers.get("Content-Length")
        try:
            with open(part, "ab" if resumed else "wb") as f:
                shutil.copyfileobj(r, f, 1 << 20)
        except (OSError, http.client.HTTPException) as e:  # a dropped connection: the next fetch resumes it
            raise FetchError(f"{url}: download interrupted ({e})") from None
    return int(total) if total and total.isdigit() else -1


def http_folder(url: str, tmp: Path) -> dict:
    """Fetch a folder through its manifest, each file verified; files it does not list are removed."""
    root = url.rstrip("/") + "/"
    with _open(root + MANIFEST) as r:
        try:
            files = json.loads(r.read())["files"]
        except (ValueError, KeyError, TypeError):
            raise FetchError(f"{root}{MANIFEST} is not an areal-kit manifest; expected "
                             '{"uri": ..., "files": {relpath: [size, sha256]}}') from None
    for rel, (size, digest) in files.items():
        if rel.startswith("/") or ".." in Path(rel).parts:
            raise FetchError(f"{root}{MANIFEST} lists {rel!r}; expected paths inside the folder")
        p = tmp / rel
        if p.is_file() and p.stat().st_size == size and sha256(p) == digest:
            continue  # fetched before an interruption
        p.parent.mkdir(parents=True, exist_ok=True)
        part = partial_path(p)
        http_file(root + urllib.parse.quote(rel), part)
        if part.stat().st_size != size or sha256(part) != digest:
            part.unlink()
            raise FetchError(f"{root}{rel} does not match its manifest (size {size}, sha256 {digest})")
        os.replace(part, p)
    for p in sorted(tmp.rglob("*"), reverse=True):
        if p.is_file() and str(p.relative_to(tmp)) not in files:
            p.unlink()
    return files


def copy_from(path: Path, target: Path) -> int | None:
    """file:// on this machine: a folder into target (a folder), a file to target (its size)."""
    if not path.exists():
        raise FetchError(f"{path} not found", 404)
    if path.is_dir():
        shutil.copytree(path, target, dirs_exist_ok=True, ignore=shutil.ignore_patterns(MANIFEST))
        return None
    shutil.copyfile(path, target)
    return path.stat().st_size


Filler = Callable[[str, Path], "int | dict | None"]


def fetch(a: Asset, mirror: str = "", local: Filler | None = None) -> str:
    """Fetch a unless its destination is complete; a line saying which ("present ..." / "fetched ...").

    http(s) and file:// are fetched here; local(base, target) fetches the other schemes (hf://,
    generated). Generated sources come from the mirror where it has them, else are built here."""
    if check(a)[0]:
        return f"present {a.name} {a.dest}"
    src = mirror_url(a.uri, mirror)
    folder = is_folder(a.uri)
    if folder is None:
        folder = Path(urllib.parse.unquote(src.split("://", 1)[1])).is_dir()
    # A folder's filler returns its files' checksums (or None), a file's its size: the one put takes.
    put: Callable[[Asset, Callable[[Path], Any]], str] = fetch_folder if folder else fetch_file
    if src.startswith(("http://", "https://", "file://")):
        get: Callable[[Path], Any]
        if src.startswith("file://"):
            get = functools.partial(copy_from, Path(urllib.parse.unquote(src[len("file://"):])))
        else:
            get = functools.partial(http_folder if folder else http_file, src)
        try:
            return put(a, get)
        except FetchError as e:
            if not (e.status == 404 and a.base.startswith(GENERATED) and local):
                raise
    if local is None:
        raise FetchError(f"{a.name}: {a.base} needs the runtime image's libraries; fetch it with "
                         "python -m areal_kit.cluster.fetch")
    return put(a, lambda target: local(a.base, target))
