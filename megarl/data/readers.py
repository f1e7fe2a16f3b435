"""Row readers for prompt datasets: jsonl, parquet, a directory or glob of them, a ``datasets`` dir.

A ``RowStore`` is random access over all rows of all files without turning the data
into Python lists: a jsonl file is indexed by the byte offset of each line (one
int64 per row, read back with ``seek``), parquet files are read by pyarrow into
columnar Arrow memory, and a ``datasets`` ``save_to_disk`` directory is opened with
``datasets.load_from_disk`` (memory-mapped Arrow). ``row(i)`` returns the row as a
dict plus where it came from (``file:line N`` / ``file:row N``) for error messages;
a jsonl line that is not a JSON object comes back as a ``BadRow``.
"""

from __future__ import annotations

import bisect
import glob as globlib
import json
from array import array
from dataclasses import dataclass
from pathlib import Path

SUFFIXES = (".jsonl", ".parquet")


@dataclass
class BadRow:
    """A row that could not be read at all (why), at ``where``."""

    where: str
    why: str


class JsonlFile:
    """Rows of a jsonl file; the byte offset of every non-blank line is indexed once."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offsets, self.lines = array("q"), array("q")
        pos = 0
        with open(path, "rb") as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    self.offsets.append(pos)
                    self.lines.append(lineno)
                pos += len(line)
        self._f = None

    def __len__(self) -> int:
        return len(self.offsets)

    def row(self, i: int) -> tuple[str, dict | BadRow]:
        where = f"{self.path}:line {self.lines[i]}"
        if self._f is None:
            self._f = open(self.path, "rb")
        self._f.seek(self.offsets[i])
        raw = self._f.readline()
        try:  # decoded here: json.loads(bytes) guesses UTF-16/32 from junk bytes and blames that codec
            text = raw.decode("utf-8-sig")
        except UnicodeDecodeError as exc:
            return where, BadRow(where, f"not UTF-8 text (byte {exc.start + 1} of the line: "
                                        f"{raw[exc.start:exc.start + 4]!r}); jsonl is read as UTF-8")
        try:
            value = json.loads(text)
        except ValueError as exc:
            return where, BadRow(where, f"not valid JSON ({exc})")
        if not isinstance(value, dict):
            return where, BadRow(where, f"a JSON {type(value).__name__}, not an object")
        return where, value

    def columns(self) -> set[str] | None:
        return None  # per row: a jsonl file has no schema


class ArrowRows:
    """Rows of an Arrow-backed table (a parquet file read by pyarrow, or a ``datasets.Dataset``)."""

    def __init__(self, path: Path, table, label: str = "row") -> None:
        self.path, self.table, self.label = path, table, label

    def __len__(self) -> int:
        return self.table.num_rows

    def row(self, i: int) -> tuple[str, dict]:
        return f"{self.path}:{self.label} {i}", self.table.slice(i, 1).to_pylist()[0]

    def columns(self) -> set[str]:
        """Every column and, through struct columns, every dotted field (``reward_model.ground_truth``)."""
        import pyarrow as pa

        out: set[str] = set()

        def walk(prefix: str, typ) -> None:
            out.add(prefix)
            if pa.types.is_struct(typ):
                for f in typ:
                    walk(f"{prefix}.{f.name}", f.type)

        for f in self.table.schema:
            walk(f.name, f.type)
        return out


def _parquet(path: Path) -> ArrowRows:
    import pyarrow.parquet as pq

    return ArrowRows(path, pq.read_table(path, memory_map=True))


def _datasets_dir(path: Path) -> ArrowRows:
    import datasets

    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise ValueError(f"{path}: a DatasetDict without a 'train' split (splits: {', '.join(ds)}); "
                             "point data.path at one split's directory")
        ds, path = ds["train"], path / "train"
    return ArrowRows(path, ds.data.table, "row")


def is_datasets_dir(path: Path) -> bool:
    return path.is_dir() and ((path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file())


def resolve_files(spec: str, key: str = "data.path") -> list[Path]:
    """The files (or ``datasets`` dirs) that ``spec`` names, sorted; a clear error when there are none."""
    path = Path(spec)
    if any(ch in spec for ch in "*?["):
        found = sorted(Path(p) for p in globlib.glob(spec, recursive=True))
        files = [p for p in found if p.suffix in SUFFIXES or is_datasets_dir(p)]
        if not files:
            raise FileNotFoundError(f"{key}={spec!r}: the glob matches no {'/'.join(SUFFIXES)} file "
                                    f"({len(found)} other paths)")
        return files
    if not path.exists():
        raise FileNotFoundError(f"{key}={spec!r}: no such file or directory")
    if is_datasets_dir(path):
        return [path]
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in SUFFIXES)
        if not files:
            raise FileNotFoundError(f"{key}={spec!r}: the directory holds no {'/'.join(SUFFIXES)} file and is "
                                    "not a datasets save_to_disk directory")
        return files
    if path.suffix not in SUFFIXES:
        raise ValueError(f"{key}={spec!r}: unknown format {path.suffix!r}; valid: {', '.join(SUFFIXES)}, a "
                         "directory or glob of them, or a datasets save_to_disk directory")
    return [path]


def open_file(path: Path):
    if is_datasets_dir(path):
        return _datasets_dir(path)
    if path.suffix == ".parquet":
        return _parquet(path)
    return JsonlFile(path)


class RowStore:
    """All rows of the files ``spec`` names, in file order, with random access by global index."""

    def __init__(self, spec: str, key: str = "data.path") -> None:
        self.spec = spec
        self.parts = [open_file(p) for p in resolve_files(spec, key)]
        self.starts = [0]
        for part in self.parts:
            self.starts.append(self.starts[-1] + len(part))
        if not len(self):
            raise ValueError(f"{key}={spec!r}: the dataset is empty (no rows in "
                             f"{', '.join(str(p.path) for p in self.parts)})")

    def __len__(self) -> int:
        return self.starts[-1]

    def row(self, i: int) -> tuple[str, dict | BadRow]:
        part = bisect.bisect_right(self.starts, i) - 1
        return self.parts[part].row(i - self.starts[part])

    def has_key(self, key: str) -> bool:
        """Whether any row has ``key``, a column or a dotted path into nested fields (a schema lookup for Arrow
        files, a scan for jsonl)."""
        for part in self.parts:
            cols = part.columns()
            if cols is not None:
                if key in cols:
                    return True
                continue
            for j in range(len(part)):
                _, value = part.row(j)
                if isinstance(value, dict) and get_field(value, key) is not MISSING:
                    return True
        return False

    def column_names(self, rows: int = 100) -> list[str]:
        """The columns (and dotted fields of nested ones) that exist: the schema of Arrow files, the keys of the
        first ``rows`` rows of jsonl files; for error messages."""
        names: set[str] = set()
        for part in self.parts:
            cols = part.columns()
            if cols is None:
                cols = set()
                for j in range(min(rows, len(part))):
                    _, value = part.row(j)
                    if isinstance(value, dict):
                        cols |= set(dotted_fields(value))
            names |= cols
        return sorted(names)


MISSING = object()


def get_field(row: dict, key: str):
    """``row[key]``, else the nested field a dotted ``key`` names (``reward_model.ground_truth``); MISSING if none."""
    if key in row:
        return row[key]
    value = row
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return MISSING
        value = value[part]
    return value


def dotted_fields(row: dict, prefix: str = "", depth: int = 2) -> list[str]:
    """The keys of ``row`` and, ``depth`` levels down, the dotted keys of its nested mappings."""
    out = []
    for k, v in row.items():
        name = f"{prefix}{k}"
        out.append(name)
        if isinstance(v, dict) and depth > 1:
            out += dotted_fields(v, name + ".", depth - 1)
    return out
