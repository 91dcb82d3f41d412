"""Hypothesis strategies for the swarm's wire types whose invariants random values rarely meet: file
entries (safe relative paths) and manifests (contiguous files, matching hash count and root)."""

from __future__ import annotations

from hypothesis import strategies as st

from crypto.digests import DIGEST_SIZE
from crypto.keys import ADDRESS_SIZE, Address
from protocol.manifest import DELTA_FILE_NAME, FileEntry, Manifest, build_manifest, piece_count_for
from tests.strategies.messages import register_strategy

_component = st.text(alphabet="abcXYZ019._-", min_size=1, max_size=12).filter(lambda s: not s.endswith("."))
relative_paths = st.lists(_component, min_size=1, max_size=3).map("/".join)
"""Paths every manifest accepts (the alphabet cannot spell a Windows device name; no trailing dot)."""


@st.composite
def file_entries(draw: st.DrawFn) -> FileEntry:
    return FileEntry(draw(relative_paths), draw(st.integers(0, 1 << 40)), draw(st.integers(0, 1 << 40)))


@st.composite
def manifests(draw: st.DrawFn) -> Manifest:
    names = draw(st.lists(relative_paths, min_size=1, max_size=5, unique_by=str.casefold))
    folded = {n.casefold() for n in names}
    names = [n for n in names if not any(other.startswith(n.casefold() + "/") for other in folded)]
    sizes = draw(st.lists(st.integers(0, 20_000), min_size=len(names), max_size=len(names)))
    files = list(zip(names, sizes, strict=True))
    if sum(sizes) == 0:
        files[0] = (files[0][0], 1)
    piece_size = 1 << draw(st.integers(10, 14))
    count = piece_count_for(sum(size for _, size in files), piece_size)
    hashes = draw(st.binary(min_size=count * DIGEST_SIZE, max_size=count * DIGEST_SIZE))
    return build_manifest(
        run=draw(st.from_regex(r"[a-z0-9][a-z0-9._-]{0,20}", fullmatch=True)),
        step=draw(st.integers(0, (1 << 62) - 1)),
        piece_size=piece_size,
        files=files,
        piece_hashes=hashes,
        signer=Address(draw(st.binary(min_size=ADDRESS_SIZE, max_size=ADDRESS_SIZE))),
    )


@st.composite
def delta_manifests(draw: st.DrawFn) -> Manifest:
    """A delta version: one ``weights.delta`` file, distinct 32-byte base and target ids."""
    size = draw(st.integers(1, 20_000))
    piece_size = 1 << draw(st.integers(10, 14))
    count = piece_count_for(size, piece_size)
    base, target = draw(
        st.lists(st.binary(min_size=DIGEST_SIZE, max_size=DIGEST_SIZE), min_size=2, max_size=2, unique=True)
    )
    return build_manifest(
        run=draw(st.from_regex(r"[a-z0-9][a-z0-9._-]{0,20}", fullmatch=True)),
        step=draw(st.integers(0, (1 << 62) - 1)),
        piece_size=piece_size,
        files=[(DELTA_FILE_NAME, size)],
        piece_hashes=draw(st.binary(min_size=count * DIGEST_SIZE, max_size=count * DIGEST_SIZE)),
        signer=Address(draw(st.binary(min_size=ADDRESS_SIZE, max_size=ADDRESS_SIZE))),
        base=base,
        target=target,
    )


register_strategy(FileEntry, file_entries())
register_strategy(Manifest, st.one_of(manifests(), delta_manifests()))
