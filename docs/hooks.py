"""MkDocs hook: the configuration reference, generated from ``ThunderSyncConfig`` at build time.

``docs/configuration.md`` holds the hand-written introduction and the placeholder line
``<!-- thundersync:config-reference -->``; ``on_page_markdown`` replaces the placeholder with one table
per section of ``thundersync_verl.config.ThunderSyncConfig`` (``thundersync``, then each nested section
such as ``thundersync.env`` and ``thundersync.opd``), read from the dataclass fields themselves:

- key: the field's name; a nested section is a field whose default factory is another section class;
- default: the field's default (or its factory's value), written as on a hydra command line;
- accepts: what the field's checker accepts, taken from the checker's own refusal of a value no
  checker accepts, so the text is the one a bad value's error message shows;
- description: the one-line doc each field declares with ``_key(default, checker, "doc")``.

Latency-model keys (``thundersync.env.tool_latency``, ``verifier_latency``) come from the fields of
``thundersync_verl.envs.latency.LatencyModel`` and the comment beside each in its source.

A missing placeholder fails the build, so the page cannot silently lose its reference.
"""

from __future__ import annotations

import dataclasses
import inspect
import re

PLACEHOLDER = "<!-- thundersync:config-reference -->"
PAGE = "configuration.md"


class _Unacceptable:
    """A value no checker accepts (not a number, bool, string, path, mapping or null)."""

    def __repr__(self) -> str:
        return "<unacceptable>"


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _accepts(check, key: str) -> str:
    """The checker's own words for what it accepts (its refusal of an unacceptable value)."""
    try:
        check(_Unacceptable(), key)
    except Exception as refused:  # noqa: BLE001 - the config module's private _Refused carries the text
        text = str(refused)
    else:
        return "any value"
    return re.sub(r"one of \(([^)]*)\)",
                  lambda m: "one of " + ", ".join(f"`{o.strip()}`" for o in m.group(1).replace("'", "").split(",") if o.strip()),
                  text)


def _default(field):
    return field.default_factory() if field.default is dataclasses.MISSING else field.default


def _latency_rows() -> list[str]:
    from thundersync_verl.envs.latency import KINDS, LatencyModel

    comments = {}
    for line in inspect.getsource(LatencyModel).splitlines():
        match = re.match(r"\s+(\w+): [^=]+= [^#]+#\s*(.*)$", line)
        if match:
            comments[match.group(1)] = match.group(2).replace("``", "`")
    rows = ["| key | default | description |", "|---|---|---|"]
    for f in dataclasses.fields(LatencyModel):
        doc = comments.get(f.name, "")
        if f.name == "kind":
            doc = "shape of the distribution: " + ", ".join(f"`{k}`" for k in KINDS)
        rows.append(f"| `{f.name}` | `{f.default}` | {_cell(doc)} |")
    return rows


def reference_markdown() -> str:
    """The generated reference: one table per section of ``ThunderSyncConfig``."""
    from thundersync_verl import config as cfg
    from thundersync_verl.envs.latency import LatencyModel

    sections: list[tuple[str, type]] = [("thundersync", cfg.ThunderSyncConfig)]
    out: list[str] = []
    latency_keys: list[str] = []
    i = 0
    while i < len(sections):
        prefix, cls = sections[i]
        i += 1
        doc = (inspect.getdoc(cls) or "").split("\n")[0]
        anchor = prefix.replace(".", "-")
        out += [f"### `{prefix}` {{#{anchor}}}", "", _cell(doc.replace("``", "`")), "",
                "| key | default | accepts | description |", "|---|---|---|---|"]
        for f in dataclasses.fields(cls):
            if "check" not in f.metadata:
                continue  # verl's own base-config bookkeeping (_target_), not a key
            key = f"{prefix}.{f.name}"
            default = _default(f)
            if isinstance(default, cfg._Section):
                sections.append((key, type(default)))
                default_cell, accepts = "(section)", f"a section: see [`{key}`](#{key.replace('.', '-')})"
            elif isinstance(default, LatencyModel):
                latency_keys.append(key)
                default_cell = f"`{cfg._hydra(default)}`"
                accepts = "a mapping of latency keys: see [latency models](#latency-models)"
            else:
                default_cell, accepts = f"`{cfg._hydra(default)}`", _accepts(f.metadata["check"], key)
            out.append(f"| `{f.name}` | {default_cell} | {_cell(accepts)} | {_cell(f.metadata['doc'])} |")
        out.append("")
    if latency_keys:
        out += ["### Latency models {#latency-models}", "",
                "The keys " + ", ".join(f"`{k}`" for k in latency_keys) + " each take a mapping of these keys "
                "(unknown keys are refused; a key left out keeps the default below).", ""]
        out += _latency_rows() + [""]
    return "\n".join(out)


def on_page_markdown(markdown, page, config, files):
    if page.file.src_uri != PAGE:
        return markdown
    if PLACEHOLDER not in markdown:
        from mkdocs.exceptions import PluginError

        raise PluginError(f"docs/{PAGE} lost the line {PLACEHOLDER!r} that the generated configuration reference replaces")
    return markdown.replace(PLACEHOLDER, reference_markdown())
