"""What the start page needs besides the queue: the config reference, keys checked as they are typed, the model
families, the short form's recipe and overrides, the machine's GPUs and what a data folder holds.

The UI process never imports torch: the config reference (in sdtrain.cli, above the UI) and the family registry
(which imports torch and every family's classes) come from a child Python once, cached for the UI's life; the
keys are checked in-process with sdtrain.config, which needs neither.
"""

from __future__ import annotations

import json
import logging
import math
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import yaml

from sdtrain.config import load_config_without
from sdtrain.errors import UserError
from sdtrain.ui import jobs
from sdtrain.ui.jobs import Refused

log = logging.getLogger(__name__)

# Seconds a child may take to print the reference or the families: importing torch and every family is slow
# on a busy machine, but not this slow.
CHILD_TIMEOUT_S = 180
MODES = ("lora", "full", "dreambooth", "textual_inversion")
# The bundled recipe each mode starts from, unless the family has its own (FAMILY_RECIPE below).
MODE_RECIPE = {"lora": "lora", "full": "finetune-full", "dreambooth": "dreambooth",
               "textual_inversion": "textual-inversion"}
FAMILY_RECIPE = {"lora": "{family}-lora", "full": "{family}-finetune"}
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".gif", ".tif", ".tiff")
# Keys the as-you-type check stops after: a pasted file of nonsense must not keep a thread busy.
MAX_PROBLEMS = 30

KEYS_CODE = ("import json, sys\n"
             "from sdtrain.cli.config_reference import sections\n"
             "json.dump([{'section': title, 'name': k.name, 'type': k.type, 'default': k.default, 'doc': k.doc}\n"
             "           for title, _, keys in sections() for k in keys], sys.stdout)\n")
FAMILIES_CODE = ("import json, sys\n"
                 "from sdtrain.models.families import FAMILIES\n"
                 "json.dump([{'name': n, 'title': f.title} for n, f in FAMILIES.items()], sys.stdout)\n")


# ---------------------------------------------------------------------------------------------- children
# Module-level so tests can swap in harmless children.


def keys_command() -> list[str]:
    return [sys.executable, "-c", KEYS_CODE]


def families_command() -> list[str]:
    return [sys.executable, "-c", FAMILIES_CODE]


def devices_command() -> list[str] | None:
    """nvidia-smi's GPU list, or None where the machine has no nvidia-smi (then it has no GPU the UI can hand out)."""
    smi = shutil.which("nvidia-smi")
    return [smi, "--query-gpu=index,name,memory.total", "--format=csv,noheader"] if smi else None


def _child_json(argv: list[str]) -> Any:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, stdin=subprocess.DEVNULL,
                          env=jobs.child_environment())
    if done.returncode != 0:
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        raise Refused(f"{' '.join(argv[:2])} failed: {lines[-1] if lines else f'exit {done.returncode}'}")
    return json.loads(done.stdout)


class Cached:
    """One child's answer, asked once (the first caller waits; the others wait on the same answer)."""

    def __init__(self, command: Any):
        self.command = command
        self._lock = threading.Lock()
        self._value: Any = None

    def get(self) -> Any:
        with self._lock:
            if self._value is None:
                self._value = _child_json(self.command())
            return self._value


# The UI's life long: the reference and the families change only with the installed sdtrain.
KEYS = Cached(lambda: keys_command())
FAMILIES = Cached(lambda: families_command())


def warm() -> None:
    for cached in (KEYS, FAMILIES):
        try:
            cached.get()
        except Exception as exc:  # noqa: BLE001 - the page asks again, and shows the reason then
            log.warning("sdtrain ui: %s", exc)


# ---------------------------------------------------------------------------------------------- GPUs


def devices() -> list[dict[str, Any]]:
    """The GPUs of this machine as nvidia-smi lists them: index, name, memory; [] without nvidia-smi."""
    argv = devices_command()
    if not argv:
        return []
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.warning("sdtrain ui: nvidia-smi did not answer: %s", exc)
        return []
    found = []
    for line in done.stdout.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 3 and parts[0].isdigit():
            found.append({"index": int(parts[0]), "name": parts[1], "memory": parts[2]})
    return found


def check_gpus(gpus: Any, available: list[dict[str, Any]]) -> list[int]:
    """A start request's `gpus`: distinct integers among the machine's GPUs."""
    if gpus is None or gpus == []:
        return []
    if not isinstance(gpus, list) or not all(isinstance(g, int) and not isinstance(g, bool) for g in gpus):
        raise Refused("gpus: pass a list of GPU indices, e.g. [0, 2]")
    known = {d["index"] for d in available}
    unknown = [g for g in gpus if g not in known]
    if unknown:
        have = ", ".join(str(i) for i in sorted(known)) or "none"
        raise Refused(f"gpus: {unknown[0]} is not a GPU of this machine (it has: {have}); GET /api/devices lists them")
    if len(set(gpus)) != len(gpus):
        raise Refused("gpus: each GPU once")
    return sorted(gpus)


# ---------------------------------------------------------------------------------------------- keys as typed


def key_lines(text: str) -> dict[str, int]:
    """Each dotted key of a YAML mapping to the line (1-based) it is written on."""
    found: dict[str, int] = {}

    def walk(node: yaml.Node, prefix: str) -> None:
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                if isinstance(key, yaml.ScalarNode):
                    name = f"{prefix}{key.value}"
                    found.setdefault(name, key.start_mark.line + 1)
                    walk(value, f"{name}.")

    try:
        walk(yaml.compose(text), "")
    except yaml.YAMLError:
        pass
    return found


def _delete(tree: dict, key: str) -> bool:
    """Drop a dotted key from a nested mapping; False where it is not there."""
    *parents, last = key.split(".")
    for part in parents:
        tree = tree.get(part) if isinstance(tree, dict) else None
        if not isinstance(tree, dict):
            return False
    if isinstance(tree, dict) and last in tree:
        del tree[last]
        return True
    return False


_KEY_OF = re.compile(r"^(?:command line: )?([A-Za-z_][\w.\-]*): ")
# OmegaConf names a top-level key it does not know only inside its message.
_TOP_KEY = re.compile(r"^Key '([^']+)' not in 'RunConfig'")


def check_keys(text: str, overrides: list[str], scratch: Path) -> list[dict[str, Any]]:
    """Every problem sdtrain.config finds in the YAML text on its own: unknown keys, wrong types, bad choices, each
    {key, line, message}. run_dir, data.shards and the keys the text leaves ??? get placeholders
    (load_config_without), so a recipe reads as fine; what only the models can say waits for the full check."""
    try:
        jobs.check_yaml(text)
    except Refused as exc:
        match = re.search(r"line (\d+)", str(exc))
        return [{"key": None, "line": int(match.group(1)) if match else None, "message": str(exc)}]
    tree, lines = yaml.safe_load(text), key_lines(text)
    scratch.mkdir(parents=True, exist_ok=True)
    path = scratch / f"keys-{time.monotonic_ns()}.yaml"
    problems: list[dict[str, Any]] = []
    try:
        # Loading stops at the first key OmegaConf refuses: drop that key and load again, to name every one.
        while len(problems) < MAX_PROBLEMS:
            path.write_text(yaml.safe_dump(tree, sort_keys=False))
            try:
                load_config_without(path, overrides)
                break
            except UserError as exc:
                found = [_problem(line, path, lines) for line in str(exc).splitlines() if line.strip()]
            problems += [p for p in found if p not in problems]
            if not any(p["key"] and _delete(tree, p["key"]) for p in found):
                break
    finally:
        path.unlink(missing_ok=True)
    return problems[:MAX_PROBLEMS]


def _problem(line: str, path: Path, lines: dict[str, int]) -> dict[str, Any]:
    message = line.removeprefix(f"{path}: ")
    match = _KEY_OF.match(message) or _TOP_KEY.match(message)
    key = match.group(1) if match else None
    if key and not message.startswith(("command line: ", f"{key}: ")):
        message = f"{key}: {message}"
    # An override's problem has no line in the text, though the text may set the same key.
    line = lines.get(key) if key and not message.startswith("command line: ") else None
    return {"key": key, "line": line, "message": message}


# ---------------------------------------------------------------------------------------------- the short form


def text_field(form: dict[str, Any], name: str, required: bool = True) -> str | None:
    value = form.get(name)
    if value is None or (isinstance(value, str) and not value.strip()):
        if required:
            raise Refused(f"{name}: fill it in")
        return None
    if not isinstance(value, str) or not value.isprintable() or len(value) > 4096:
        raise Refused(f"{name}: one line of text")
    return value.strip()


def _number(form: dict[str, Any], name: str, kind: type) -> str | None:
    value = form.get(name)
    if value is None or value == "":
        return None
    try:
        number = kind(value)
    except (TypeError, ValueError):
        raise Refused(f"{name}: {json.dumps(str(value)[:40])} is not a{'n integer' if kind is int else ' number'}") \
            from None
    if not (number > 0 and math.isfinite(number)) or (kind is int and number != float(value)):
        raise Refused(f"{name}: {value} must be a positive {'integer' if kind is int else 'number'}")
    return str(number)


def form_recipe(form: dict[str, Any], families: list[str], recipes: list[str], root: Path) -> dict[str, Any]:
    """The short form as a bundled recipe and overrides: {recipe, overrides}. Paths the user typed reach the
    run only as override values; a relative data folder is read under the root where it is there."""
    mode = form.get("mode") or "lora"
    if mode not in MODES:
        raise Refused(f"mode '{mode}': one of {', '.join(MODES)}")
    family = text_field(form, "family", required=False)
    if family is not None and family not in families:
        raise Refused(f"family '{family}': one of {', '.join(families)}")
    own = FAMILY_RECIPE.get(mode, "").format(family=family) if family else ""
    recipe = own if own in recipes else MODE_RECIPE[mode]
    data = text_field(form, "data")
    if not Path(data).is_absolute() and (root / data).exists():
        data = str((root / data).resolve())
    overrides = [f"model.pretrained={text_field(form, 'pretrained')}", f"data.shards={data}"]
    if family:
        overrides.append(f"model.family={family}")
    for name, key, kind in (("steps", "train.max_steps", int), ("lr", "optim.lr", float),
                            ("resolution", "data.resolution", int), ("batch_size", "data.batch_size", int)):
        value = _number(form, name, kind)
        if value is not None:
            overrides.append(f"{key}={value}")
    return {"recipe": recipe, "overrides": jobs.check_overrides(overrides)}


def inspect_data(path_text: str, root: Path) -> dict[str, Any]:
    """What a data folder holds: `shards` (ready), `images` (needs `sdtrain prepare folder`), `empty` or
    `missing`; a relative path is read under the root."""
    path = Path(path_text).expanduser()
    path = path if path.is_absolute() else root / path
    if not path.is_dir():
        return {"path": str(path), "kind": "missing"}
    if (path / "manifest.json").is_file() or any(path.glob("*.tar")):
        return {"path": str(path), "kind": "shards"}
    images = 0
    for found in path.rglob("*"):
        images += found.suffix.lower() in IMAGE_SUFFIXES
        if images >= 1000:  # enough to say what it is; a huge folder is not counted to its end
            break
    return {"path": str(path), "kind": "images" if images else "empty", "images": images}
