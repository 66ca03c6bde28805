"""How one setting is declared and how a raw value of it is read and checked (``llm_api.model.settings``
declares the settings with these and is the only module that reads the environment).

``setting(env, default, doc, ...)`` declares a ``Settings`` field as a ``Setting``: its variable, default, bounds
or choices and README text; ``Setting.read`` turns the variable's raw value into the field's value by the
declaration (a choice, a bool, an int or float within bounds, a string through its ``parse``, or a ``derive``
from several variables). The parsers here are the ``parse``/``derive`` of the settings whose values have a
shape of their own: LLM_API_KEY (keys and their ``priority=N`` grants), LORA_ADAPTERS, SERVED_MODEL_NAME,
DEVICE_MAP, END_OF_STREAM_TOKEN, RESPONSES_STORE_PATH and the TLS files. Every refusal is a ``ConfigError``
naming the variable and its allowed values (never a key's text).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

MIN_API_KEY_CHARS = 8


class ConfigError(ValueError):
    """A setting has a value the server cannot run with."""


def parse_marker(raw: str) -> str:
    """END_OF_STREAM_TOKEN: at least 2 characters, starting with one that can only occur inside a JSON
    string of an error object (so an error can always be written without the marker in it, see
    llm_api.errors.hide_marker), and without line breaks."""
    allowed = "at least 2 characters, no line breaks, not starting with a space, digit, '-' or one of {}[]\":,\\"
    if len(raw) < 2 or raw[0] in ' \t{}[]":,\\-0123456789' or any(c in raw for c in "\r\n"):
        raise ConfigError(f"END_OF_STREAM_TOKEN={raw!r} is not supported; allowed values: {allowed}")
    return raw


PRIORITY_OPTION = "priority="
# A request's priority field's range (protocols/common/checks.py takes it from here), and a key's grant's.
PRIORITY_MIN, PRIORITY_MAX = -(2**31), 2**31 - 1


def _key_entries(raw: str) -> list[list[str]]:
    """LLM_API_KEY's entries, each split at its spaces: [key, *options] (an empty entry is [])."""
    return [entry.split() for entry in raw.split(",")] if raw else []


def split_api_keys(raw: str) -> tuple[str, ...]:
    """LLM_API_KEY's keys: comma-separated (vLLM's ``--api-key`` also takes several), so no key holds a comma;
    an entry's options (after the key, separated by spaces: a key holds none) are not part of it."""
    return tuple(words[0] if words else "" for words in _key_entries(raw))


def api_key_priorities(raw: str) -> dict[str, int]:
    """Each key of LLM_API_KEY given a ``priority=N`` option, with its N (see ``Settings.api_key_priorities``)."""
    return {words[0]: int(words[1][len(PRIORITY_OPTION):]) for words in _key_entries(raw) if len(words) == 2}


def parse_api_key(raw: str) -> str:
    """LLM_API_KEY: empty (a key is generated at start), or one or more comma-separated keys, each what a
    client sends after ``Bearer ``: visible ASCII without spaces (it travels in a header), long enough not to
    be guessed in a few tries, and no key twice (two names for one owner would be a mistake). A key may be
    followed by one option, ``priority=N`` (an integer; ``Settings.api_key_priorities``). The message names
    the key by its position and length, never by its value, nor an option's text (a key mistyped with a
    space in it would otherwise show its second half)."""
    if raw == "":
        return raw
    allowed = (f"one or more keys separated by commas, each at least {MIN_API_KEY_CHARS} visible ASCII characters "
               "without spaces or commas and optionally followed by a space and priority=<integer>, or unset to "
               "generate one")
    entries = _key_entries(raw)
    for position, words in enumerate(entries, start=1):
        key = words[0] if words else ""
        where = f"key {position} of {len(entries)}" if len(entries) > 1 else "the key"
        if len(key) < MIN_API_KEY_CHARS or not all("!" <= c <= "~" for c in key):
            raise ConfigError(f"LLM_API_KEY is not usable ({where} has {len(key)} characters); allowed values: "
                              f"{allowed}")
        if len(words) > 2 or (len(words) == 2 and not _priority_option(words[1])):
            raise ConfigError(f"LLM_API_KEY is not usable ({where} is followed by text that is not one option "
                              f"{PRIORITY_OPTION}<integer from {PRIORITY_MIN} to {PRIORITY_MAX}>); allowed values: "
                              f"{allowed}")
    keys = split_api_keys(raw)
    if len(set(keys)) != len(keys):
        raise ConfigError(f"LLM_API_KEY is not usable (a key is listed twice); allowed values: {allowed}")
    return raw


def _priority_option(word: str) -> bool:
    value = re.fullmatch(re.escape(PRIORITY_OPTION) + r"(-?[0-9]+)", word, re.ASCII)
    return value is not None and PRIORITY_MIN <= int(value[1]) <= PRIORITY_MAX


def parse_store_path(raw: str) -> str:
    """RESPONSES_STORE_PATH: empty (memory), or an SQLite file. Whether it opens is checked when the store is
    opened (llm_api.protocols.responses.store.open_response_store), which names this variable too."""
    if raw and (raw != raw.strip() or "\0" in raw):
        raise ConfigError(f"RESPONSES_STORE_PATH={raw!r} is not supported; allowed values: empty (memory) or a "
                          "file path without leading or trailing spaces")
    return raw


def tls_file_parser(name: str) -> Callable[[str], str]:
    """SSL_KEYFILE, SSL_CERTFILE, SSL_CA_CERTS: empty (off) or a file path. Whether the file can be read and
    what it holds is checked when the server starts (llm_api.server.tls), which names the variable too."""

    def parse(raw: str) -> str:
        if raw and (raw != raw.strip() or "\0" in raw):
            raise ConfigError(f"{name}={raw!r} is not supported; allowed values: empty (off) or a file path without "
                              "leading or trailing spaces")
        return raw

    return parse


def parse_lora_adapters(raw: str) -> tuple[tuple[str, str], ...]:
    """LORA_ADAPTERS: ``name=path,...``; names as llm_api.lora.config.ADAPTER_NAME allows (checked there too,
    where the adapters are read)."""
    pairs: list[tuple[str, str]] = []
    for item in (part.strip() for part in raw.split(",")):
        if not item:
            continue
        name, sep, path = item.partition("=")
        name, path = name.strip(), path.strip()
        if not sep or not path or not _ADAPTER_NAME.fullmatch(name):
            raise ConfigError(f"LORA_ADAPTERS entry {item!r} is not supported; allowed values: name=path pairs "
                              f"separated by commas, names of 1-64 characters A-Z a-z 0-9 . _ - (a letter or digit first)")
        if any(name == n for n, _ in pairs):
            raise ConfigError(f"LORA_ADAPTERS names adapter {name!r} twice")
        pairs.append((name, path))
    return tuple(pairs)


_ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
# A served name: what clients put in "model" (vLLM's --served-model-name takes hub ids such as
# meta-llama/Llama-3.2-1B, Ollama's names carry a tag after ':'); no spaces, commas or control characters.
_SERVED_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}")


def served_model_names(env: Mapping[str, str], earlier: Mapping[str, Any]) -> tuple[str, ...]:
    """SERVED_MODEL_NAME: more names of the base model, separated by commas or spaces (MODEL_NAME stays its
    first name and its TorchServe path); a name listed twice or equal to MODEL_NAME is refused."""
    names = tuple(env.get("SERVED_MODEL_NAME", "").replace(",", " ").split())
    for name in names:
        if not _SERVED_NAME.fullmatch(name):
            raise ConfigError(f"SERVED_MODEL_NAME entry {name[:80]!r} is not supported; allowed values: names of 1-128 "
                              "characters A-Z a-z 0-9 . _ : / - (a letter or digit first), separated by commas or spaces")
    if len(set(names)) != len(names) or earlier["model_name"] in names:
        raise ConfigError("SERVED_MODEL_NAME lists a name twice (MODEL_NAME is always served: do not repeat it)")
    return names


def _choice(env: Mapping[str, str], name: str, default: str, allowed: tuple[str, ...],
            aliases: tuple[str, ...] = ()) -> str:
    raw = env.get(name, default)
    value = raw.strip().lower()
    if value in aliases:
        value = allowed[0]
    if value not in allowed:
        shown = ", ".join("None" if a == "none" else a for a in allowed)
        raise ConfigError(f"{name}={raw!r} is not supported; allowed values: {shown}")
    return value


def _bool(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{name}={raw!r} is not a boolean; allowed values: true, false, 1, 0, yes, no, on, off")


def _int(env: Mapping[str, str], name: str, default: int, minimum: int) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer; allowed values: integers >= {minimum}") from None
    if value < minimum:
        raise ConfigError(f"{name}={raw!r} is out of range; allowed values: integers >= {minimum}")
    return value


def _float(env: Mapping[str, str], name: str, default: float, low: float, high: float | None) -> float:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    allowed = f"numbers in ({low}, {high}]" if high is not None else f"numbers > {low}"
    try:
        value = float(raw.strip())
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number; allowed values: {allowed}") from None
    if not value > low or (high is not None and value > high) or value != value:
        raise ConfigError(f"{name}={raw!r} is out of range; allowed values: {allowed}")
    return value


def check_device_map(raw: str) -> str:
    """Validate DEVICE_MAP as accelerate understands it; keep the raw string (parsed at load)."""
    value = raw.strip()
    allowed = "auto, cpu, cuda, cuda:N, mps, an integer GPU index, or a JSON object of module -> device"
    if value in ("auto", "cpu", "cuda", "mps", "balanced", "sequential") or value.isdigit():
        return value
    if value.startswith("cuda:") and value[5:].isdigit():
        return value
    if value.startswith("{"):
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            raise ConfigError(f"DEVICE_MAP={raw!r} is not valid JSON; allowed values: {allowed}") from None
        if isinstance(parsed, dict) and parsed:
            bad = {k: d for k, d in parsed.items() if not _is_device(d)}
            if bad:
                raise ConfigError(f"DEVICE_MAP={raw!r} maps modules to unknown devices {bad}; a module's device "
                                  f"is cpu, disk, cuda, cuda:N, mps or a GPU index")
            return value
    raise ConfigError(f"DEVICE_MAP={raw!r} is not supported; allowed values: {allowed}")


def _is_device(device) -> bool:
    """One value of a JSON device map, as accelerate takes it ("disk": offloaded to OFFLOAD_FOLDER)."""
    if isinstance(device, int) and not isinstance(device, bool):
        return device >= 0
    if not isinstance(device, str):
        return False
    return device in ("cpu", "disk", "cuda", "mps") or (device.startswith("cuda:") and device[5:].isdigit())


# A derived setting's reader: the environment, and the values of the settings declared before it.
Derive = Callable[[Mapping[str, str], Mapping[str, Any]], Any]


@dataclass(frozen=True)
class Setting:
    """One environment variable: how it is read and validated, and how the README shows it.

    How ``read`` turns the variable into a value follows from the declaration: ``derive`` when given (a value
    made from several variables); else ``choices`` (one of them, case-insensitive); else the default's type:
    a bool, an int (``>= minimum``), a float (``> minimum`` and ``<= maximum`` when given) or a string, passed
    through ``parse`` when given. Unset (and for bool, int and float also empty) is the default."""

    env: str
    default: Any
    doc: str  # the README's "values" column (markdown)
    minimum: float | None = None
    maximum: float | None = None
    choices: tuple[str, ...] = ()
    aliases: tuple[str, ...] = ()  # raw values also read as choices[0] ("", "off": QUANTIZATION=none)
    parse: Callable[[str], Any] | None = None
    derive: Derive | None = None
    shown_default: str | None = None  # the README's default column, where the default alone would mislead
    default_note: str = ""  # said after the shown default: "(auto)"
    joins_previous: bool = False  # shares the README row of the setting declared before it
    flag: str | None = None  # also an option of `llm_api serve` ("--ssl-keyfile"), over the variable
    flag_help: str = ""  # the option's line in `llm_api serve --help`

    def read(self, env: Mapping[str, str], earlier: Mapping[str, Any]) -> Any:
        if self.derive is not None:
            return self.derive(env, earlier)
        if self.choices:
            return _choice(env, self.env, self.default, self.choices, self.aliases)
        if isinstance(self.default, bool):
            return _bool(env, self.env, self.default)
        if isinstance(self.default, int):
            assert self.minimum is not None, self.env
            return _int(env, self.env, self.default, int(self.minimum))
        if isinstance(self.default, float):
            assert self.minimum is not None, self.env
            return _float(env, self.env, self.default, self.minimum, self.maximum)
        raw = env.get(self.env, self.default)
        return self.parse(raw) if self.parse is not None else raw

    def readme_default(self) -> str:
        if self.shown_default is not None:
            return self.shown_default
        value = self.default
        if isinstance(value, bool):
            shown = "`true`" if value else "`false`"
        elif isinstance(value, float):
            shown = f"`{value:g}`"
        elif value in ("", ()):
            shown = "empty"
        else:
            shown = f"`{value}`"
        return f"{shown} {self.default_note}" if self.default_note else shown


def setting(env: str, default: Any, doc: str, *, repr: bool = True, **options: Any) -> Any:
    """A ``Settings`` field read from the variable ``env`` (``options``: the rest of ``Setting``)."""
    return field(default=default, repr=repr, metadata={"setting": Setting(env, default, doc, **options)})
