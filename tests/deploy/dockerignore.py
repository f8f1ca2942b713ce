"""The Docker build context a directory sends, by its .dockerignore.

Follows the rules Docker documents for .dockerignore and implements in
moby/patternmatcher (no Docker engine runs here): one pattern per line,
`#` comment lines and blank lines skipped, each pattern trimmed, cleaned
like a path and made relative to the context root; `*` and `?` stay inside
one path segment, `**` spans any number of them, `!` re-includes; a pattern
that matches a directory excludes everything below it; the last pattern that
matches a path decides. (Docker also sends the Dockerfile and .dockerignore
when they are excluded; tally's .dockerignore lets both in.)
test_docker_context.py compares this with the docker CLI where one is
installed.

    patterns = read_patterns("/src/.dockerignore")
    files = context_files("/src", patterns)    # {"CMakeLists.txt", ...}
"""

import os
import posixpath
import re

# Characters a pattern means literally that a regular expression would not.
_REGEX_SPECIAL = set(".+()|{}$")


def read_patterns(path):
    """[(pattern, exclusion)] of a .dockerignore, in order; exclusion True
    for a `!` line (it re-includes what it matches)."""
    patterns = []
    with open(path, encoding="utf-8-sig") as f:
        for line in f.read().splitlines():
            if line.startswith("#"):
                continue
            line = line.strip()
            if not line:
                continue
            exclusion = line.startswith("!")
            if exclusion:
                line = line[1:].strip()
            line = posixpath.normpath(line)
            if len(line) > 1 and line.startswith("/"):
                line = line[1:]
            patterns.append((_compile(line), exclusion))
    return patterns


def _compile(pattern):
    """The regular expression of one pattern (moby/patternmatcher's rules)."""
    regex = "^"
    position = 0
    while position < len(pattern):
        char = pattern[position]
        position += 1
        if char == "*":
            if pattern[position:position + 1] == "*":
                position += 1
                if pattern[position:position + 1] == "/":
                    position += 1
                regex += ".*" if position == len(pattern) else "(.*/)?"
            else:
                regex += "[^/]*"
        elif char == "?":
            regex += "[^/]"
        elif char == "\\":
            if position < len(pattern):
                regex += re.escape(pattern[position])
                position += 1
            else:
                regex += "\\\\"
        elif char in _REGEX_SPECIAL:
            regex += "\\" + char
        else:
            regex += char  # literal, or part of a [character class]
    return re.compile(regex + "$")


def excluded(path, patterns):
    """Whether `path` (relative, with /) stays out of the context: the last
    pattern matching it or one of its parent directories decides."""
    parts = path.split("/")
    candidates = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    matched = False
    for regex, exclusion in patterns:
        # An exclusion can only change an excluded path, and the reverse.
        if exclusion != matched:
            continue
        if any(regex.match(candidate) for candidate in candidates):
            matched = not exclusion
    return matched


def context_files(root, patterns):
    """The relative paths of the files (and links) under `root` that the
    context holds."""
    files = set()
    for directory, subdirectories, names in os.walk(root):
        relative = os.path.relpath(directory, root)
        for name in names + [d for d in subdirectories
                             if os.path.islink(os.path.join(directory, d))]:
            path = name if relative == "." else f"{relative}/{name}"
            if not excluded(path, patterns):
                files.add(path)
    return files
