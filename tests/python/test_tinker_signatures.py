"""tally_client.tinker against a table of Tinker's published SDK surface
(tinker_signatures.json, written from Tinker 0.25.0's source: public names,
method parameters, type fields), so that a drift on either side shows:

- every name of `tinker` and `tinker.types` exists, except those the
  table's tally_differences lists, which must really be missing;
- every method takes Tinker's parameters first, in Tinker's order, with
  Tinker's kinds and defaults; tally's further parameters are keyword-only
  with defaults;
- every type has Tinker's fields (and for the types a program builds,
  Tinker's defaults)."""

import ast
import dataclasses
import inspect
import json
import os
import unittest

from tally_client import tinker
from tally_client.tinker import types

TABLE_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                          "tinker_signatures.json")
with open(TABLE_PATH, encoding="utf-8") as table_file:
    TABLE = json.load(table_file)
DIFFERENCES = TABLE["tally_differences"]
NAMESPACES = {"tinker": tinker, "tinker.types": types}


def our_callable(qualified):
    """The function of "Class.method" in tally_client.tinker."""
    cls, method = qualified.split(".")
    return getattr(getattr(tinker, cls), method)


def parameters(function):
    """[(name, "positional" | "keyword", default repr or None)] of a
    function, as the table writes them (self, *args, **kwargs aside)."""
    kinds = {inspect.Parameter.POSITIONAL_ONLY: "positional",
             inspect.Parameter.POSITIONAL_OR_KEYWORD: "positional",
             inspect.Parameter.KEYWORD_ONLY: "keyword"}
    return [(p.name, kinds[p.kind],
             None if p.default is inspect.Parameter.empty
             else repr(p.default))
            for p in inspect.signature(function).parameters.values()
            if p.kind in kinds and p.name not in ("self", "cls")]


def literal(text):
    """A default as the table writes it, as the repr ours has."""
    return None if text is None else repr(ast.literal_eval(text))


class NamesTest(unittest.TestCase):

    def test_tinkers_names_exist_except_the_listed_ones(self):
        for namespace, names in TABLE["names"].items():
            missing = set(DIFFERENCES["missing_names"][namespace])
            for name in names:
                with self.subTest(namespace=namespace, name=name):
                    self.assertEqual(
                        hasattr(NAMESPACES[namespace], name),
                        name not in missing,
                        "present" if name in missing else "missing")


class SignaturesTest(unittest.TestCase):

    def test_tinkers_parameters_come_first_as_tinkers(self):
        for qualified, theirs in TABLE["signatures"].items():
            skipped = DIFFERENCES["missing_parameters"].get(qualified, [])
            with self.subTest(qualified):
                ours = parameters(our_callable(qualified))
                want = [(name, kind, literal(default))
                        for name, kind, default in theirs
                        if name not in skipped]
                self.assertEqual(ours[:len(want)], want)
                self.assertFalse(
                    [name for name in skipped
                     if name in [p[0] for p in ours]],
                    "listed as missing but present")
                extra = ours[len(want):]
                self.assertEqual(
                    [p for p in extra if p[1] != "keyword" or p[2] is None],
                    [], "tally's extras must be keyword-only with defaults")

    def test_keywords_tinker_takes_through_kwargs(self):
        for qualified, names in TABLE["kwargs"].items():
            ours = {p[0]: p for p in parameters(our_callable(qualified))}
            for name in names:
                with self.subTest(qualified=qualified, name=name):
                    self.assertEqual(ours[name][1:], ("keyword", "None"))

    def test_every_async_variant_takes_the_same_parameters(self):
        for qualified in TABLE["signatures"]:
            if not qualified.endswith("_async"):
                continue
            with self.subTest(qualified):
                self.assertEqual(
                    parameters(our_callable(qualified)),
                    parameters(our_callable(qualified[:-len("_async")])))


class FieldsTest(unittest.TestCase):

    def test_types_have_tinkers_fields_and_defaults(self):
        for name, theirs in TABLE["fields"].items():
            skipped = DIFFERENCES["missing_fields"].get(name, [])
            ours = {field.name: field
                    for field in dataclasses.fields(getattr(types, name))}
            for field, default in theirs:
                with self.subTest(type=name, field=field):
                    self.assertEqual(field in ours, field not in skipped)
                    if field in ours and name in TABLE["defaults_compared"]:
                        ours_default = ours[field].default
                        self.assertEqual(
                            None if ours_default is dataclasses.MISSING
                            else repr(ours_default), literal(default))


if __name__ == "__main__":
    unittest.main()
