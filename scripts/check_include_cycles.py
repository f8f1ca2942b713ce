#!/usr/bin/env python3
"""Finds include circles between the project's files, and between its rooms.

A file pair x.h + x.cc is one node "x"; x depends on y when x.h or x.cc
includes y.h (by its path from the source root, or relative to the including
file). Every elementary cycle of that graph is printed. The same is done for
the rooms, the libraries the files make up: a file's room is its top
directory (base, server, ...), or for a file under one of --rooms-under
(runtime), the directory below that (runtime/model, runtime/parallel, ...);
a room depends on another when one of its files, tests (*_test.cc) left out,
includes a header of the other. The exit status is 1 when either graph has a
cycle, 0 otherwise (2: bad arguments).

  scripts/check_include_cycles.py                 # the tree this script is in
  scripts/check_include_cycles.py --root DIR --dirs base runtime
  scripts/check_include_cycles.py --rooms-under     # top directories only
"""

import argparse
import os
import re
import sys

DEFAULT_DIRS = ("base", "runtime", "server", "client", "kernels")
DEFAULT_ROOMS_UNDER = ("runtime",)
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


def room_of(node, rooms_under):
    """The room of a node: runtime/model for runtime/model/x, base for
    base/x (rooms_under holds "runtime")."""
    parts = node.split("/")
    if parts[0] in rooms_under and len(parts) > 2:
        return "/".join(parts[:2])
    return parts[0]


def room_graph(graph, rooms_under):
    """Returns ({room: set of rooms it includes}, {(room, room): one
    (node, node) include behind that edge}), tests left out."""
    rooms, witness = {}, {}
    for node in sorted(graph):
        if node.endswith("_test"):
            continue
        room = room_of(node, rooms_under)
        rooms.setdefault(room, set())
        for target in sorted(graph[node]):
            other = room_of(target, rooms_under)
            if other != room:
                rooms[room].add(other)
                witness.setdefault((room, other), (node, target))
    for targets in list(rooms.values()):
        for other in targets:
            rooms.setdefault(other, set())
    return rooms, witness


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
    parser.add_argument("--rooms-under", nargs="*",
                        default=list(DEFAULT_ROOMS_UNDER),
                        help="directories whose subdirectories are rooms")
    args = parser.parse_args(argv)
    for directory in args.dirs:
        if not os.path.isdir(os.path.join(args.root, directory)):
            parser.error(f"--dirs: {directory} is not a directory under "
                         f"{args.root}")

    graph = include_graph(args.root, args.dirs)
    cycles, truncated = find_cycles(graph)
    for cycle in cycles:
        print(f"include cycle: {' -> '.join(cycle + cycle[:1])}")
    for component in truncated:
        print(f"more than {MAX_CYCLES_SHOWN} cycles among: "
              f"{', '.join(component)}")
    if cycles or truncated:
        print("Break each cycle by moving what the including file needs into "
              "a header of its own (x.h + x.cc are one node).")
    rooms, witness = room_graph(graph, set(args.rooms_under))
    room_cycles, room_truncated = find_cycles(rooms)
    for cycle in room_cycles:
        hops = [witness[(a, b)] for a, b in zip(cycle, cycle[1:] + cycle[:1])]
        print(f"room cycle: {' -> '.join(cycle + cycle[:1])} ("
              + "; ".join(f"{a} includes {b}" for a, b in hops) + ")")
    for component in room_truncated:
        print(f"more than {MAX_CYCLES_SHOWN} room cycles among: "
              f"{', '.join(component)}")
    if room_cycles or room_truncated:
        print("Rooms depend one way: move the file to the room it belongs "
              "to, or what it needs into a lower room.")
    failed = cycles or truncated or room_cycles or room_truncated
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
