"""Write docs/config-reference.md from the code: every key of ``host.toml``
and of the pool's files (``pool.toml``, the tenants file, the hosts file),
with its type, default and meaning.

    .venv/bin/python docs/configref.py           # (re)write docs/config-reference.md
    .venv/bin/python docs/configref.py --check   # exit 1 when it does not match the code

A documentation tool, kept out of the wheels (nothing deployed needs it);
tests/docs/test_config_reference.py fails when the page and the code differ.

The meaning of a key sits next to its field in the config dataclasses
(``accelmig.plugin.config``, ``accelmig.pool.config``), in the field's
``metadata``:

- ``doc``: the meaning (required for every key and every section);
- ``key``: the TOML key, when it is not the field's name;
- ``section``: the table a scalar field of the top-level class lives in
  (``HostConfig.host_id`` is ``[host] id``);
- ``type``: the type as the operator writes it, when the annotation would
  mislead (``"size"``: bytes, or a string such as ``"64MiB"``);
- ``default``: the default in words, when it is computed at load time;
- ``example``: a valid value, shown in the page's sample file and used by
  the tests (required where there is no literal default);
- ``toml``: ``False`` for a field that is no key (``HostConfig.source``).

A field whose type is itself a config dataclass is a section (``[pool]``,
``[fabric]``, ``[hostd]`` of ``HostConfig``).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import sys
import types
import typing
from pathlib import Path

from accelmig.plugin import config as host_config
from accelmig.pool import config as pool_config
from accelmig.wire import driverconfig

PAGE = Path(__file__).resolve().parent / "config-reference.md"
COMMAND = ".venv/bin/python docs/configref.py"
NO_DEFAULT = object()
_UNITS = (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))


@dataclasses.dataclass
class Key:
    """One key of one table, read from its dataclass field."""

    section: str
    name: str                   # as written in the TOML file
    field: dataclasses.Field
    owner: type                 # the dataclass the field belongs to
    type: str
    doc: str
    default: object             # the literal default, or NO_DEFAULT
    default_text: str           # the default as shown (words or a TOML literal)
    example: object             # a valid value, or NO_DEFAULT
    flag: str | None = None     # the command-line option that overrides it

    @property
    def required(self) -> bool:
        return self.default is NO_DEFAULT and "default" not in self.field.metadata

    @property
    def literal(self) -> bool:
        """The default is the field's literal one (not one computed at load)."""
        return self.default not in (NO_DEFAULT, None) and "default" not in self.field.metadata

    @property
    def sample(self):
        """The value the page's sample file shows: the example, else the default."""
        return self.example if self.example is not NO_DEFAULT else self.default


@dataclasses.dataclass
class Section:
    title: str                  # "host", "tenants.NAME"
    sample_title: str           # the table name in the sample file ("tenants.alice")
    doc: str
    keys: list[Key]


@dataclasses.dataclass
class ConfigFile:
    name: str
    intro: str
    sections: list[Section]


# -- reading the dataclasses --------------------------------------------------


def _type_name(annotation, meta) -> str:
    if "type" in meta:
        return _SIZE_TYPE if meta["type"] == "size" else meta["type"]
    origin = typing.get_origin(annotation)
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if origin in (typing.Union, types.UnionType) and len(args) == 1:
        return _type_name(args[0], {})
    simple = {str: "string", bool: "boolean", int: "integer", float: "number"}
    if annotation in simple:
        return simple[annotation]
    if origin in (tuple, list) and typing.get_args(annotation)[:1] == (str,):
        return "array of strings"
    raise TypeError(f"cannot name the TOML type of {annotation!r}: give the field a metadata 'type'")


_SIZE_TYPE = 'size (bytes, or a string such as "64MiB")'


def format_size(value: int) -> str:
    """The largest binary unit that divides ``value`` exactly: ``1 << 30`` -> ``"1GiB"``."""
    for unit, factor in _UNITS:
        if value and value % factor == 0:
            return f"{value // factor}{unit}"
    return str(value)


def toml_value(value, size: bool = False) -> str:
    """``value`` as a TOML literal."""
    if size and isinstance(value, int) and not isinstance(value, bool):
        return json.dumps(format_size(value))
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)        # a JSON string of these is a TOML basic string
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v, size) for v in value) + "]"
    if isinstance(value, dict):         # an inline table (keys are bare words here)
        return "{ " + ", ".join(f"{k} = {toml_value(v, size)}" for k, v in value.items()) + " }"
    raise TypeError(f"no TOML literal for {value!r}")


def _literal_default(field: dataclasses.Field):
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return NO_DEFAULT


def _key(section: str, field: dataclasses.Field, owner: type, hints: dict) -> Key:
    meta = field.metadata
    if not str(meta.get("doc", "")).strip():
        raise ValueError(f"{owner.__qualname__}.{field.name} has no metadata 'doc' (its meaning)")
    size = meta.get("type") == "size"
    default = _literal_default(field)
    if "default" in meta:
        default_text = meta["default"]
    elif default is NO_DEFAULT:
        default_text = "required"
    elif default is None:
        default_text = "unset"
    else:
        default_text = f"`{toml_value(default, size)}`"
    return Key(section=section, name=meta.get("key", field.name), field=field, owner=owner,
               type=_type_name(hints[field.name], meta), doc=" ".join(meta["doc"].split()),
               default=default, default_text=default_text,
               example=meta.get("example", NO_DEFAULT))


def _keys(section: str, cls: type) -> list[Key]:
    hints = typing.get_type_hints(cls)
    return [_key(section, f, cls, hints) for f in dataclasses.fields(cls) if f.metadata.get("toml", True)]


def sections_of(cls: type, title: str | None = None, sample_title: str | None = None,
                doc: str = "", docs: dict | None = None) -> list[Section]:
    """The tables of ``cls``: its scalar keys (under ``title`` or their
    metadata ``section``; ``docs`` says what such a table is), and a table
    per field that is a dataclass."""
    hints = typing.get_type_hints(cls)
    out: dict[str, Section] = {}
    for field in dataclasses.fields(cls):
        if not field.metadata.get("toml", True):
            continue
        kind = hints[field.name]
        if dataclasses.is_dataclass(kind):
            if not str(field.metadata.get("doc", "")).strip():
                raise ValueError(f"{cls.__qualname__}.{field.name} has no metadata 'doc'")
            out[field.name] = Section(field.name, field.name, " ".join(field.metadata["doc"].split()),
                                      _keys(field.name, kind))
            continue
        name = field.metadata.get("section", title)
        if name is None:
            raise ValueError(f"{cls.__qualname__}.{field.name}: which table? (metadata 'section')")
        section = out.setdefault(name, Section(name, sample_title or name,
                                               (docs or {}).get(name, doc), []))
        section.keys.append(_key(name, field, cls, hints))
    return list(out.values())


def _pool_flags() -> dict[str, str]:
    """``accelmig-pool serve``'s options, by the config key each one overrides."""
    import click

    from accelmig.pool.cli import serve
    return {p.name: p.opts[0] for p in serve.params if isinstance(p, click.Option)}


def files() -> list[ConfigFile]:
    host_sections = sections_of(host_config.HostConfig, docs={"host": "This host."})
    pool_sections = sections_of(pool_config.PoolConfig, "pool", doc="The pool node.")
    flags = _pool_flags()
    for key in pool_sections[0].keys:
        key.flag = flags.get(key.field.name)
    return [
        ConfigFile("host.toml", (
            f"A hypervisor host's configuration, `{host_config.DEFAULT_PATH}` "
            "(`--config FILE` or `$ACCELMIG_CONFIG` elsewhere). Read by `accelmig hostd`, the "
            "libvirt hook and every `accelmig` command; an unknown section or key is an error, "
            "so a typo never silently becomes a default. Only `[pool] endpoint` is required."),
            host_sections),
        ConfigFile("pool.toml", (
            "The pool node's configuration: `accelmig-pool serve --config FILE`, a `[pool]` "
            "table; every key is optional, and a command-line option (the *flag* column) "
            "overrides its key. An unknown key is an error."),
            pool_sections),
        ConfigFile("tokens.toml", (
            "The tenants file (`[pool] tokens`): one `[tenants.NAME]` table per tenant; at least "
            "one. It holds secrets: owned by the pool's user, mode 0600."),
            sections_of(pool_config.TenantSpec, "tenants.NAME", "tenants.alice",
                        doc="One tenant; NAME is how the pool's logs and quotas name it.")),
        ConfigFile("hosts.toml", (
            "The hypervisor hosts file (`[pool] hosts`): one `[hosts.NAME]` table per host, NAME "
            "being the host's `[host] id`; a host without a table cannot use the control plane. "
            "It holds secrets: owned by the pool's user, mode 0600."),
            sections_of(pool_config.HostSpec, "hosts.NAME", "hosts.hostA",
                        doc="One hypervisor host (not `admin`: that name is the admin socket's).")),
        ConfigFile("driver.toml", (
            f"A guest's drivers' configuration, `{driverconfig.DEFAULT_PATH}` "
            f"(`${driverconfig.PATH_ENV}` elsewhere): where the pool is and how to reach it, for the "
            "OpenCL driver (`libaccelmig-opencl.so`) and the Python driver. A TOML subset (one "
            "`key = value` a line, strings in double quotes; a guest needs no TOML library): every key "
            "optional, the environment (`ACCELMIG_ENDPOINT`, `ACCELMIG_TOKEN`, `ACCELMIG_CAFILE`, "
            "`ACCELMIG_INSECURE`, `ACCELMIG_TIMEOUT`) wins over it, and the guest agent's answer "
            "wins for the endpoint. An unknown key is a warning (a newer file, an older driver). A file "
            "holding `token` must be readable by the application's user only."),
            sections_of(driverconfig.DriverConfig, "driver",
                        doc="The keys (at the top of the file, or in a `[driver]` table).")),
    ]


# -- writing ------------------------------------------------------------------


def sample_toml(cfile: ConfigFile, every_key: bool = True) -> str:
    """A file of ``cfile``: with ``every_key``, every key at its example (else
    its default); without, only the keys with a literal default at it and
    the required ones at their example: what loading it must give back."""
    lines: list[str] = []
    for section in cfile.sections:
        body = []
        for key in section.keys:
            size = key.field.metadata.get("type") == "size"
            if every_key:
                value = key.sample
            elif key.required:
                value = key.example
            elif key.literal:
                value = key.default
            else:
                continue
            body.append(f"{key.name} = {toml_value(value, size)}")
        if body:
            lines += [f"[{section.sample_title}]", *body, ""]
    return "\n".join(lines).rstrip() + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render() -> str:
    out = [
        "# Configuration reference",
        "",
        "<!-- Generated from the code by docs/configref.py: do not edit by hand. After a",
        f"     change to a config dataclass run: {COMMAND} -->",
        "",
        "Every key of every configuration file, read from the config dataclasses "
        "(`accelmig.plugin.config`, `accelmig.pool.config`), where each key's meaning "
        "sits next to its field. A test fails when this page and the code differ. "
        "How the files fit together on real machines: [deploy.md](deploy.md).",
        "",
    ]
    for cfile in files():
        out += [f"## {cfile.name}", "", cfile.intro, ""]
        with_flags = any(k.flag for s in cfile.sections for k in s.keys)
        for section in cfile.sections:
            out += [f"### `[{section.title}]`", ""]
            if section.doc:
                out += [section.doc, ""]
            head = ["key", "type", "default"] + (["flag"] if with_flags else []) + ["meaning"]
            out += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
            for key in section.keys:
                row = [f"`{key.name}`", key.type, key.default_text]
                if with_flags:
                    row.append(f"`{key.flag}`" if key.flag else "—")
                row.append(key.doc)
                out.append("| " + " | ".join(_cell(c) for c in row) + " |")
            out.append("")
        out += ["Every key in one file (examples where there is one, else the default):", "",
                "```toml", sample_toml(cfile).rstrip(), "```", ""]
    return "\n".join(out).rstrip() + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 when it differs")
    parser.add_argument("-o", "--output", type=Path, default=PAGE)
    args = parser.parse_args(argv)
    text = render()
    current = args.output.read_text() if args.output.exists() else ""
    if args.check:
        if current == text:
            return 0
        sys.stdout.writelines(difflib.unified_diff(current.splitlines(True), text.splitlines(True),
                                                   str(args.output), "from the code"))
        print(f"\n{args.output} does not match the code; run: {COMMAND}", file=sys.stderr)
        return 1
    if current != text:
        args.output.write_text(text)
        print(f"wrote {args.output}")
    else:
        print(f"{args.output} is up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
