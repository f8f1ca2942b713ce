#!/usr/bin/env python3
"""Finds include circles between the project's files.

A file pair x.h + x.cc is one node "x"; x depends on y when x.h or x.cc
includes y.h (by its path from the source root, or relative to the including
file). Every elementary cycle of that graph is printed, and the exit status is
1 when there is one, 0 otherwise (2: bad arguments).

  scripts/check_include_cycles.py                 # the tree this script is in
  scripts/check_include_cycles.py --root DIR --dirs base runtime
"""

import argparse
import os
import re
import sys

DEFAULT_DIRS = ("base", "runtime", "server", "client", "kernels")
SOURCE_SUFFIXES = (".h", ".cc", ".cu", ".cuh")

# Cycles printed per strongly connected component before the rest is counted.
MAX_CYCLES_SHOWN = 50

INCLUDE_RE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.MULTILINE)


def source_files(root, dirs):
    """Yields the source files under root/dir for each dir, root-relative."""
    for directory in dirs:
        for parent, subdirs, files in os.walk(os.path.join(root, directory)):
            subdirs.sort()
            for name in sorted(files):
                if name.endswith(SOURCE_SUFFIXES):
                    path = os.path.join(parent, name)
                    yield os.path.relpath(path, root).replace(os.sep, "/")


def node_of(path):
    """The node of a file: its path without the suffix."""
    return os.path.splitext(path)[0]


def include_graph(root, dirs):
    """Returns {node: set of nodes whose header it includes}."""
    files = list(source_files(root, dirs))
    headers = {path for path in files if path.endswith((".h", ".cuh"))}
    graph = {node_of(path): set() for path in files}
    for path in files:
        with open(os.path.join(root, path), encoding="utf-8",
                  errors="replace") as source:
            text = source.read()
        here = os.path.dirname(path)
        for included in INCLUDE_RE.findall(text):
            relative = os.path.normpath(os.path.join(here, included))
            for candidate in (included, relative.replace(os.sep, "/")):
                if candidate in headers:
                    target = node_of(candidate)
                    if target != node_of(path):
                        graph[node_of(path)].add(target)
                    break
    return graph


def strongly_connected(graph):
    """Tarjan's algorithm, iterative: the components with more than one node."""
    index, low, on_stack, stack, components = {}, {}, set(), [], []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            advanced = False
            for successor in successors:
                if successor not in index:
                    index[successor] = low[successor] = counter
                    counter += 1
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(graph[successor]))))
                    advanced = True
                    break
                if successor in on_stack:
                    low[node] = min(low[node], index[successor])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(component)
    return components


def elementary_cycles(graph, component, limit):
    """The elementary cycles inside one component, each starting at its
    smallest node, at most limit of them; and whether some were left out."""
    cycles = []
    for start in sorted(component):
        allowed = {node for node in component if node >= start}
        path = [start]
        work = [iter(sorted(graph[start] & allowed))]
        while work:
            successor = next(work[-1], None)
            if successor is None:
                work.pop()
                path.pop()
                continue
            if successor == start:
                if len(cycles) == limit:
                    return cycles, True
                cycles.append(list(path))
            elif successor not in path:
                path.append(successor)
                work.append(iter(sorted(graph[successor] & allowed)))
    return cycles, False


def find_cycles(graph, limit=MAX_CYCLES_SHOWN):
    """Returns (cycles, truncated components) over the whole graph."""
    cycles, truncated = [], []
    for component in strongly_connected(graph):
        found, more = elementary_cycles(graph, component, limit)
        cycles.extend(found)
        if more:
            truncated.append(sorted(component))
    return sorted(cycles), truncated


def main(argv):
    here = os.path.dirname(os.path.abspath(__file__))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=os.path.dirname(here),
                        help="the source root (default: this script's ../)")
    parser.add_argument("--dirs", nargs="+", default=list(DEFAULT_DIRS),
                        help="directories under --root to check")
    args = parser.parse_args(argv)
    for directory in args.dirs:
        if not os.path.isdir(os.path.join(args.root, directory)):
            parser.error(f"--dirs: {directory} is not a directory under "
                         f"{args.root}")

    cycles, truncated = find_cycles(include_graph(args.root, args.dirs))
    failed = bool(cycles or truncated)
    for cycle in cycles:
        print(f"include cycle: {' -> '.join(cycle + cycle[:1])}")
    for component in truncated:
        print(f"more than {MAX_CYCLES_SHOWN} cycles among: "
              f"{', '.join(component)}")
    if failed:
        print("Break each cycle by moving what the including file needs into "
              "a header of its own (x.h + x.cc are one node).")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
