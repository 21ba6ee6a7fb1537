"""docs/config-reference.md is generated from the code (docs/configref.py
reads the config dataclasses' field metadata): it must match the code,
every key must say what it means, and files built from what the page
documents must load through the real loaders as documented."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import ipaddress
import re
import sys
import typing
from pathlib import Path

import pytest

from accelmig.plugin.config import HostConfig
from accelmig.pool.config import HostSpec, PoolConfig, TenantSpec, load_hosts, load_tenants, parse_size
from accelmig.wire import driverconfig
from accelmig.wire.errors import ConfigInvalid

CHECKOUT = Path(__file__).resolve().parents[2]


def _load_generator():
    spec = importlib.util.spec_from_file_location("accelmig_docs_configref", CHECKOUT / "docs" / "configref.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module         # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


configref = _load_generator()


@functools.cache
def files() -> dict:
    """The generator's model of the files, read inside the tests (so that a
    field without a meaning fails a test with its message, not the
    collection of this module)."""
    return {f.name: f for f in configref.files()}


def test_the_page_matches_the_code():
    page = CHECKOUT / "docs" / "config-reference.md"
    assert page.exists(), f"docs/config-reference.md is missing; run: {configref.COMMAND}"
    assert page.read_text() == configref.render(), \
        f"docs/config-reference.md does not match the code; run: {configref.COMMAND}"


def test_the_check_mode_tells_a_stale_page_and_the_command(tmp_path, capsys):
    stale = tmp_path / "config-reference.md"
    stale.write_text(configref.render().replace("`grace`", "`graze`"))
    assert configref.main(["--check", "-o", str(stale)]) == 1
    out = capsys.readouterr()
    assert "-| `grace`" not in out.out and "+| `grace`" in out.out
    assert configref.COMMAND in out.err
    assert configref.main(["-o", str(stale)]) == 0
    assert configref.main(["--check", "-o", str(stale)]) == 0


def _config_classes():
    """Every dataclass the files are read into, nested sections included."""
    seen, todo = [], [HostConfig, PoolConfig, TenantSpec, HostSpec, driverconfig.DriverConfig]
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen.append(cls)
        hints = typing.get_type_hints(cls)
        todo += [hints[f.name] for f in dataclasses.fields(cls) if dataclasses.is_dataclass(hints[f.name])]
    return seen


def test_every_field_has_a_meaning():
    classes = _config_classes()
    assert {c.__name__ for c in classes} >= {"HostConfig", "PoolEndpoints", "FabricConfig", "HostdConfig",
                                            "PoolConfig", "TenantSpec", "HostSpec"}
    missing = [f"{cls.__module__}.{cls.__qualname__}.{f.name}"
               for cls in classes for f in dataclasses.fields(cls)
               if f.metadata.get("toml", True) and not str(f.metadata.get("doc", "")).strip()]
    assert missing == [], "give these fields a metadata 'doc' (their meaning): " + ", ".join(missing)
    documented = {(k.owner, k.field.name) for f in files().values() for s in f.sections for k in s.keys}
    for cls in classes:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.metadata.get("toml", True) and not dataclasses.is_dataclass(hints[f.name]):
                assert (cls, f.name) in documented, f"{cls.__qualname__}.{f.name} is not on the page"
    for cfile in files().values():
        for section in cfile.sections:
            assert section.doc.strip(), f"[{section.title}] of {cfile.name} says nothing"
            for key in section.keys:
                assert key.type and key.default_text and len(key.doc) > 10, key.name
                if key.required or key.default is None:
                    assert key.example is not configref.NO_DEFAULT, \
                        f"{cfile.name} [{section.title}] {key.name}: no default, so it needs an 'example'"


def test_a_field_without_a_meaning_stops_the_generator():
    @dataclasses.dataclass
    class Undocumented:
        fine: str = dataclasses.field(default="x", metadata={"doc": "a documented key"})
        silent: int = 3

    with pytest.raises(ValueError, match="Undocumented.silent has no metadata 'doc'"):
        configref.sections_of(Undocumented, "t")


def _normal(value):
    """Parsed and documented values in one shape."""
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, (ipaddress.IPv4Network, ipaddress.IPv6Network,
                          ipaddress.IPv4Address, ipaddress.IPv6Address)):
        return str(value)
    if isinstance(value, (list, tuple)):
        return [_normal(v) for v in value]
    return value


def _expected(key, every_key: bool):
    value = key.sample if every_key else (key.example if key.required else key.default)
    if key.field.metadata.get("type") == "size" and isinstance(value, str):
        value = parse_size(value)
    if key.field.metadata.get("type") == "table of sizes" and isinstance(value, dict):
        value = {k: parse_size(v) for k, v in value.items()}
    if key.type.startswith("string (a CIDR)") or key.type.startswith("array of strings (CIDRs)"):
        value = [str(ipaddress.ip_network(v, strict=False)) for v in value] if isinstance(value, list) \
            else str(ipaddress.ip_network(value))
    return _normal(value)


def _parsed_host(text, tmp_path):
    cfg = HostConfig.from_toml(text, source="sample")
    objects = {"host": None, "pool": cfg.pool, "fabric": cfg.fabric, "hostd": cfg.hostd}
    return lambda section, key: (cfg.host_id if section == "host" else getattr(objects[section], key.field.name))


def _parsed_pool(text, tmp_path):
    path = tmp_path / "pool.toml"
    path.write_text(text)
    cfg = PoolConfig.load(str(path))
    return lambda section, key: getattr(cfg, key.field.name)


def _parsed_specs(loader, name):
    def parse(text, tmp_path):
        path = tmp_path / f"{name}.toml"
        path.write_text(text)
        specs = loader(str(path))
        return lambda section, key: getattr(specs[section.split(".", 1)[1]], key.field.name)
    return parse


def _parsed_driver(text, tmp_path):
    cfg = driverconfig.parse(text, "sample")
    return lambda section, key: getattr(cfg, key.field.name)


PARSERS = {"host.toml": _parsed_host, "pool.toml": _parsed_pool, "driver.toml": _parsed_driver,
           "tokens.toml": _parsed_specs(load_tenants, "tokens"),
           "hosts.toml": _parsed_specs(load_hosts, "hosts")}


@pytest.mark.parametrize("every_key", [False, True], ids=["defaults", "every-key"])
@pytest.mark.parametrize("name", sorted(PARSERS))
def test_the_documented_values_load_back_through_the_real_loaders(name, every_key, tmp_path):
    """``defaults``: only the keys with a literal default (at it) and the
    required ones: loading it must give exactly the documented defaults.
    ``every-key``: the page's sample file, every key present."""
    cfile = files()[name]
    text = configref.sample_toml(cfile, every_key=every_key)
    value_of = PARSERS[name](text, tmp_path)
    checked = 0
    for section in cfile.sections:
        for key in section.keys:
            if not every_key and not key.required and not key.literal:
                continue        # a default in words (computed at load): nothing literal to compare
            sample_section = section.sample_title
            assert _normal(value_of(sample_section, key)) == _expected(key, every_key), \
                f"{name} [{section.title}] {key.name}: the page and the loader disagree"
            checked += 1
    assert checked >= 2


def test_host_toml_documents_exactly_the_sections_and_keys_the_loader_reads():
    """The loader names what it knows when it meets an unknown key."""
    cfile = files()["host.toml"]
    base = configref.sample_toml(cfile)
    with pytest.raises(ConfigInvalid) as caught:
        HostConfig.from_toml(base + "\n[no_such_section]\n")
    known = re.search(r"known: ([^)]*)\)", str(caught.value)).group(1).split(", ")
    assert sorted(known) == sorted(s.title for s in cfile.sections)
    for section in cfile.sections:
        text = base.replace(f"[{section.sample_title}]\n", f"[{section.sample_title}]\nno_such_key = 1\n")
        with pytest.raises(ConfigInvalid) as caught:
            HostConfig.from_toml(text)
        read = re.search(r"known: ([^)]*)\)", str(caught.value)).group(1).split(", ")
        assert sorted(read) == sorted(k.name for k in section.keys), f"[{section.title}]"


def test_pool_toml_documents_exactly_the_keys_the_loader_accepts(tmp_path):
    keys = {k.name for s in files()["pool.toml"].sections for k in s.keys}
    assert keys == {f.name for f in dataclasses.fields(PoolConfig)}
    path = tmp_path / "pool.toml"
    path.write_text(configref.sample_toml(files()["pool.toml"]) + "no_such_key = 1\n")
    with pytest.raises(ConfigInvalid, match="unknown key"):
        PoolConfig.load(str(path))


def test_pool_flags_are_read_from_the_serve_command():
    flags = {k.name: k.flag for s in files()["pool.toml"].sections for k in s.keys}
    assert flags["listen"] == "--listen" and flags["control_listen"] == "--control-listen"
    assert flags["max_payload"] is None         # a TOML-only key


def test_sizes_are_shown_in_units_that_parse_back():
    for value in (1, 1000, 1024, 64 * 1024, 3 << 20, 1 << 30, 5 << 40):
        shown = configref.format_size(value)
        assert parse_size(shown) == value, shown
    assert configref.format_size(1 << 30) == "1GiB"
