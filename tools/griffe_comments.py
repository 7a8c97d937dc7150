"""A griffe extension for the API reference: a constant's comment block is its docstring.

The library documents a public constant by the comment block directly above its assignment
(docs/design/by_area.md, "Public API"); griffe, which mkdocstrings uses to read the code,
takes only a string after it. mkdocs.yml loads this for `docs/reference.md`.
"""

import griffe

# Comment lines that are directives to tools, not documentation.
_PRAGMAS = ("fmt:", "noqa", "type:", "pragma", "pylint", "ruff:")


class CommentDocstrings(griffe.Extension):
    """Gives a module-level attribute without a docstring the comment block above it."""

    def on_attribute_instance(self, *, node, attr, agent, **kwargs):
        if attr.docstring is not None or not attr.parent.is_module or not attr.lineno:
            return
        lines = attr.lines_collection[attr.filepath]
        comments = []
        i = attr.lineno - 2  # the line above, 0-based
        while i >= 0 and lines[i].lstrip().startswith("#"):
            text = lines[i].lstrip()[1:].lstrip(":").strip()
            if not text.startswith(_PRAGMAS):
                comments.append(text)
            i -= 1
        if comments:
            attr.docstring = griffe.Docstring("\n".join(reversed(comments)), parent=attr)
