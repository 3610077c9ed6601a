"""The registry every name-keyed kind of mmpt uses (methods, demo corpora, model presets)."""

from __future__ import annotations

import pytest

from mmpt.registry import NotRegistered, Registry


def test_builtin_entries_are_imported_on_first_lookup(tmp_path, monkeypatch):
    import sys

    (tmp_path / "things.py").write_text(
        "from mmpt.registry import Registry\nTHINGS = Registry('thing', builtin={'lazy': 'lazy_thing'})\n"
    )
    (tmp_path / "lazy_thing.py").write_text(
        "from things import THINGS\n\n\n@THINGS.register('lazy')\ndef make():\n    return 42\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    import things

    assert things.THINGS.names() == ["lazy"]
    assert "lazy_thing" not in sys.modules  # listed, not imported
    assert things.THINGS.get("lazy")() == 42
    assert "lazy_thing" in sys.modules
    monkeypatch.delitem(sys.modules, "lazy_thing")
    monkeypatch.delitem(sys.modules, "things")


def test_every_builtin_method_and_corpus_registers_under_its_name():
    from mmpt.demo import CORPORA
    from mmpt.methods import METHODS

    for registry in (METHODS, CORPORA):
        for name in registry.builtin:
            assert registry.get(name) is not None, name


def test_an_unknown_name_says_the_closest_and_lists_the_rest():
    presets = Registry("preset")
    presets.register("m2-encoder-1b", {"depth": 2})
    presets.register("m2-encoder-10b", {"depth": 3})
    with pytest.raises(
        NotRegistered,
        match=r"'m2-encoder-1bb' is not a known preset \(did you mean 'm2-encoder-1b'"
        r"\?\); known: m2-encoder-10b, m2-encoder-1b",
    ):
        presets.get("m2-encoder-1bb")


def test_a_name_taken_by_another_definition_is_refused():
    registry: Registry = Registry("corpus")

    @registry.register("a")
    def build_a():
        return 1

    assert registry.get("a") is build_a
    registry.register("a", build_a)  # the same definition again (a module imported twice): fine

    def build_other():
        return 2

    with pytest.raises(ValueError, match="a corpus named 'a' is already registered"):
        registry.register("a", build_other)
    registry.register("p", {"depth": 2})
    registry.register("p", {"depth": 2})  # equal data: fine
    with pytest.raises(ValueError, match="already registered"):
        registry.register("p", {"depth": 3})


def test_a_builtin_name_is_kept_for_its_module():
    registry: Registry = Registry("method", builtin={"clip": "mmpt.methods.clip"})

    class Mine:
        pass

    with pytest.raises(ValueError, match="method 'clip' is built in"):
        registry.register("clip", Mine())
    registry.register("mine", Mine())
    assert registry.names() == ["clip", "mine"]
