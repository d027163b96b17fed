"""Derive a repository by rewriting the history of a stored one: truncate at a commit, squash to one commit, or
remove a path from every commit. New objects are written loose into a scratch repository that borrows the source's
pack, so the derived repository is repacked and served like any other."""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import unquote_to_bytes

from kiln.ingest.download import Git, init_bare
from kiln.ingest.errors import RewriteFailed
from kiln.ingest.objects import TREE_MODE, TreeItem, rewrite_commit, serialize_tree, write_loose
from kiln.ingest.reader import Repository, split_path
from kiln.schemas.ingest import HistoryRewrite

MAIN = "refs/heads/main"


async def rewrite_into(source: Repository, rewrite: HistoryRewrite, repo_dir: Path) -> tuple[Git, str | None]:
    """A bare repository at ``repo_dir`` whose refs are the rewritten history; returns it and its HEAD branch."""
    git = await init_bare(repo_dir)
    pack_dir = repo_dir / "objects" / "pack"
    pack_dir.mkdir(parents=True, exist_ok=True)
    os.symlink(source.pack_path, pack_dir / "pack-source.pack")
    os.symlink(source.idx_path, pack_dir / "pack-source.idx")
    head: str | None = MAIN
    if rewrite.operation == "truncate":
        refs = {MAIN: source.resolve(rewrite.revision or "")}
    elif rewrite.operation == "squash":
        oid = source.resolve(rewrite.revision or "")
        body = rewrite_commit(source.raw(oid), source.commit(oid).tree, [])
        refs = {MAIN: write_loose(repo_dir, "commit", body)}
    else:
        refs, head = _remove_path(source, repo_dir, unquote_to_bytes(rewrite.path or "")), source.head
    script = "".join(f"update {name} {oid}\n" for name, oid in sorted(refs.items()))
    await git.run("update-ref", "--stdin", stdin=script.encode(errors="surrogateescape"))
    return git, head


def _remove_path(source: Repository, repo_dir: Path, path: bytes) -> dict[str, str]:
    parts = split_path(path)
    if not parts:
        raise RewriteFailed("remove_path needs a non-empty path")
    trees = source.manifest.trees
    memo: dict[tuple[str, int], str | None] = {}

    def strip(tree: str, depth: int) -> str | None:
        """The tree without parts[depth:]; None when the result is empty (git stores no empty subtrees)."""
        key = (tree, depth)
        if key in memo:
            return memo[key]
        items: list[TreeItem] = []
        changed = False
        for item in trees[tree]:
            if item.name == parts[depth]:
                if depth + 1 == len(parts):
                    changed = True
                    continue
                if item.mode == TREE_MODE:
                    new = strip(item.oid.hex(), depth + 1)
                    if new != item.oid.hex():
                        changed = True
                        if new is None:
                            continue
                        item = TreeItem(item.mode, item.name, bytes.fromhex(new))
            items.append(item)
        result: str | None = tree
        if changed:
            result = write_loose(repo_dir, "tree", serialize_tree(items)) if items or depth == 0 else None
        memo[key] = result
        return result

    new_commits: dict[str, str] = {}
    touched = False
    for oid in _parents_first(source):
        commit = source.commit(oid)
        tree = strip(commit.tree, 0) or ""
        touched |= tree != commit.tree
        parents = [new_commits[p] for p in commit.parents]
        new_commits[oid] = write_loose(repo_dir, "commit", rewrite_commit(source.raw(oid), tree, parents))
    if not touched:
        raise RewriteFailed(f"{path.decode(errors='replace')!r} is in no commit of {source.name}")
    # Annotated tags become lightweight tags on the rewritten commits: their signatures could not hold anyway.
    return {name: new_commits[oid] for name, oid in source.refs().items()}


def _parents_first(source: Repository) -> list[str]:
    commits = source.manifest.commits
    order: list[str] = []
    done: set[str] = set()
    for start in sorted(commits):
        stack = [(start, False)]
        while stack:
            oid, expanded = stack.pop()
            if oid in done:
                continue
            if expanded:
                done.add(oid)
                order.append(oid)
                continue
            stack.append((oid, True))
            stack.extend((p, False) for p in commits[oid].parents if p not in done and p in commits)
    return order
