//! Where a dataset's records come from: `data.path` resolved to its files (one file, a directory
//! or a glob of shards, in sorted order), each read as JSONL lines or Parquet rows (by extension)
//! and handed to the formats as the same JSON objects, with the location ([`Loc`]) of each
//! record for errors; `data.columns` ([`Columns`]) maps the formats' field names to the file's.
//!
//! `read_records` is the one loop every format runs its records through: the formats are written
//! once, whatever the file type.

use std::collections::BTreeMap;
use std::fmt;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Result, anyhow, bail};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::records::{LoadReport, OnError, Outcome};

/// A JSON object: one record of a dataset.
pub type JsonObject = Map<String, Value>;

/// The files of a dataset and how their columns are named.
#[derive(Clone, Debug)]
pub struct Source {
    /// `data.path` as given: a file, a directory, or a glob (`*`, `?` in the file name).
    pub path: PathBuf,
    /// The file's name for each format field that is not named as the format names it.
    pub columns: Columns,
}

impl From<&Path> for Source {
    fn from(path: &Path) -> Self {
        Source { path: path.to_path_buf(), columns: Columns::default() }
    }
}

impl Source {
    pub fn new(path: &Path, columns: &Columns) -> Self {
        Source { path: path.to_path_buf(), columns: columns.clone() }
    }

    /// The dataset's files in reading order, each with its kind: the file itself, or the
    /// `.jsonl`/`.json`/`.parquet` files of a directory or matching a glob, sorted by name.
    pub fn files(&self) -> Result<Vec<(PathBuf, FileKind)>> {
        let shown = self.path.display();
        let name = self.path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        let is_glob = name.contains(['*', '?']);
        let listed = |dir: &Path, keep: &dyn Fn(&str) -> bool| -> Result<Vec<PathBuf>> {
            let entries = std::fs::read_dir(dir)
                .map_err(|e| anyhow!("cannot read dataset directory {}: {e}", dir.display()))?;
            let mut paths = Vec::new();
            for entry in entries {
                let entry = entry.map_err(|e| anyhow!("cannot list {}: {e}", dir.display()))?;
                let p = entry.path();
                let n = entry.file_name().to_string_lossy().into_owned();
                // A link whose target is gone (a Hub snapshot missing a blob) is a shard that
                // cannot be read, not a file to pass over: reading it says so.
                let dangling = entry.file_type().is_ok_and(|t| t.is_symlink()) && !p.exists();
                if (p.is_file() || dangling) && keep(&n) {
                    paths.push(p);
                }
            }
            paths.sort();
            Ok(paths)
        };
        let paths = if is_glob {
            let dir = match self.path.parent() {
                Some(d) if !d.as_os_str().is_empty() => d,
                _ => Path::new("."),
            };
            if dir.to_string_lossy().contains(['*', '?']) {
                bail!("dataset {shown}: only the file name may hold wildcards (* and ?)");
            }
            listed(dir, &|n| glob_match(name, n))?
        } else if self.path.is_dir() {
            listed(&self.path, &|n| FileKind::by_extension(Path::new(n)).is_some())?
        } else {
            // One file named by the user: its extension, or else its first bytes, tell.
            return Ok(vec![(self.path.clone(), FileKind::of(&self.path))]);
        };
        if paths.is_empty() {
            bail!(
                "dataset {shown}: no .jsonl or .parquet file {}",
                if is_glob { "matches" } else { "in the directory" }
            );
        }
        Ok(paths.into_iter().map(|p| (FileKind::of(&p), p)).map(|(k, p)| (p, k)).collect())
    }
}

/// How a file's records are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FileKind {
    /// One JSON object per line (`.jsonl`, `.json`, `.jsonlines`, `.ndjson`).
    Jsonl,
    /// Apache Parquet (`.parquet`): one record per row.
    Parquet,
}

impl FileKind {
    /// The kind a file's extension names, if it names one.
    pub fn by_extension(path: &Path) -> Option<FileKind> {
        let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
        match ext.to_ascii_lowercase().as_str() {
            "jsonl" | "json" | "jsonlines" | "ndjson" => Some(FileKind::Jsonl),
            "parquet" => Some(FileKind::Parquet),
            _ => None,
        }
    }

    /// The kind of a file: by its extension, else Parquet if it starts with Parquet's magic
    /// bytes `PAR1`, else JSONL (an unreadable file is reported when it is read).
    pub fn of(path: &Path) -> FileKind {
        Self::by_extension(path).unwrap_or_else(|| {
            let mut magic = [0u8; 4];
            let is_parquet = std::fs::File::open(path)
                .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut magic))
                .is_ok()
                && &magic == b"PAR1";
            if is_parquet { FileKind::Parquet } else { FileKind::Jsonl }
        })
    }
}

/// `pattern` (with `*`: any run of characters, `?`: one character) matches all of `name`.
fn glob_match(pattern: &str, name: &str) -> bool {
    let (p, n): (Vec<char>, Vec<char>) = (pattern.chars().collect(), name.chars().collect());
    // Classic backtracking over the last `*`.
    let (mut i, mut j, mut star, mut mark) = (0, 0, None, 0);
    while j < n.len() {
        if i < p.len() && (p[i] == '?' || p[i] == n[j]) {
            i += 1;
            j += 1;
        } else if i < p.len() && p[i] == '*' {
            star = Some(i);
            mark = j;
            i += 1;
        } else if let Some(s) = star {
            i = s + 1;
            mark += 1;
            j = mark;
        } else {
            return false;
        }
    }
    p[i..].iter().all(|&c| c == '*')
}

/// Where a record is: its file, and its line (JSONL) or row (Parquet).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Loc {
    pub file: Arc<Path>,
    pub at: At,
}

/// A record's place in its file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum At {
    /// 1-based line of a JSONL file.
    Line(usize),
    /// 0-based row of a Parquet file (as `datasets` and pandas count), and its row group.
    Row { row: usize, group: usize },
    /// The whole file (one that cannot be read).
    File,
}

impl Loc {
    /// The 1-based line of a JSONL record.
    pub fn line(&self) -> Option<usize> {
        match self.at {
            At::Line(l) => Some(l),
            At::Row { .. } | At::File => None,
        }
    }
}

impl fmt::Display for Loc {
    /// `FILE:LINE` or `FILE: row R (row group G)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.at {
            At::Line(l) => write!(f, "{}:{l}", self.file.display()),
            At::Row { row, group } => {
                write!(f, "{}: row {row} (row group {group})", self.file.display())
            }
            At::File => write!(f, "{}", self.file.display()),
        }
    }
}

/// `data.columns`: a format's field name (`messages`, `instruction`, ...) -> the file's name
/// for it. Fields not listed keep their own name.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(transparent)]
pub struct Columns(pub BTreeMap<String, String>);

impl Columns {
    /// The file's name for the format field `field`.
    pub fn name<'a>(&'a self, field: &'a str) -> &'a str {
        self.0.get(field).map_or(field, String::as_str)
    }

    /// Refuses a key that is not one of `valid` (the fields of `format`), with a hint listing
    /// them.
    pub fn check(&self, format: &str, valid: &[&str]) -> Result<()> {
        for key in self.0.keys() {
            if !valid.contains(&key.as_str()) {
                if valid.is_empty() {
                    bail!("data.columns.{key}: the {format} format reads no columns");
                }
                bail!(
                    "data.columns.{key}: not a field of the {format} format\nhint: the keys are \
                     the format's field names ({}), the values the file's column names",
                    valid.join(", ")
                );
            }
        }
        Ok(())
    }
}

/// The fields a format reads from each record, by the format's names.
#[derive(Clone, Copy, Debug)]
pub struct Fields {
    /// Fields every record must have (a Parquet file without the column is refused at once).
    pub required: &'static [&'static str],
    /// Fields a record may lack.
    pub optional: &'static [&'static str],
    /// Names inside nested records (`role`, `content` of a message), also mappable.
    pub nested: &'static [&'static str],
}

impl Fields {
    /// Every mappable name.
    pub fn all(&self) -> Vec<&'static str> {
        [self.required, self.optional, self.nested].concat()
    }
}

/// Reads every record of `source` and calls `build` on it, file by file in [`Source::files`]
/// order, record by record in file order; returns what `build` kept.
///
/// JSONL: blank lines are skipped silently, a UTF-8 byte-order mark at the start of a file and
/// CRLF line ends are accepted. Parquet: row group by row group, only the columns of `fields`
/// (by their mapped names); a file without a required column is an error naming the file, the
/// column and the columns it has.
///
/// A record that is not a JSON object, or on which `build` returns an error, is an error
/// `LOC: <what>` under [`OnError::Fail`] and is listed in `report.skipped` under
/// [`OnError::Skip`]; [`Outcome::Skip`] is listed under both. `report.records` counts the kept
/// records. `build`'s errors should be one line without the location prefix; `build` also gets
/// the record's location.
pub fn read_records<T>(
    source: &Source,
    fields: &Fields,
    on_error: OnError,
    report: &mut LoadReport,
    build: impl FnMut(&JsonObject, &Loc) -> Result<Outcome<T>>,
) -> Result<Vec<T>> {
    let mut kept = Vec::new();
    read_records_into(source, fields, on_error, report, build, |x| {
        kept.push(x);
        Ok(())
    })?;
    Ok(kept)
}

/// [`read_records`], handing each kept value to `keep` as it is read (a loader that streams
/// its rows to disk holds none of them).
pub fn read_records_into<T>(
    source: &Source,
    fields: &Fields,
    on_error: OnError,
    report: &mut LoadReport,
    mut build: impl FnMut(&JsonObject, &Loc) -> Result<Outcome<T>>,
    mut keep: impl FnMut(T) -> Result<()>,
) -> Result<()> {
    for (path, kind) in source.files()? {
        let file: Arc<Path> = Arc::from(path.as_path());
        if let Err(e) = std::fs::File::open(&path) {
            let loc = Loc { file: file.clone(), at: At::File };
            let why = format!("cannot read the shard: {e}");
            // The one file `data.path` names is always needed; a shard of several may be
            // skipped.
            match (on_error, path == source.path) {
                (OnError::Fail, _) | (_, true) => bail!(
                    "dataset {loc}: {why}\nhint: restore the file (a dangling link points at a \
                     missing download), or set data.on_error: skip to train without it (counted)"
                ),
                (OnError::Skip, false) => {
                    report.skipped.push((loc, why));
                    continue;
                }
            }
        }
        let mut one = |at: At, obj: Result<JsonObject>| -> Result<()> {
            let loc = Loc { file: file.clone(), at };
            match obj.and_then(|obj| build(&obj, &loc)) {
                Ok(Outcome::Keep(x)) => {
                    keep(x)?;
                    report.records += 1;
                }
                Ok(Outcome::Skip(reason)) => report.skipped.push((loc, reason)),
                Err(e) => match on_error {
                    OnError::Fail => bail!("{loc}: {e:#}"),
                    OnError::Skip => report.skipped.push((loc, format!("{e:#}"))),
                },
            }
            Ok(())
        };
        match kind {
            FileKind::Jsonl => for_each_line(&path, &mut one)?,
            FileKind::Parquet => {
                let wanted = WantedColumns::new(fields, &source.columns);
                super::parquet::for_each_row(&path, &wanted, &mut one)?
            }
        }
    }
    Ok(())
}

/// The top-level columns a Parquet read projects onto, by the file's names.
pub struct WantedColumns {
    /// (format field, file column) of the fields every record needs.
    pub required: Vec<(String, String)>,
    /// The file's names of the optional fields.
    pub optional: Vec<String>,
}

impl WantedColumns {
    fn new(fields: &Fields, columns: &Columns) -> Self {
        let name = |f: &&str| columns.name(f).to_string();
        WantedColumns {
            required: fields.required.iter().map(|f| (f.to_string(), name(f))).collect(),
            optional: fields.optional.iter().map(name).collect(),
        }
    }
}

/// Every non-blank line of a JSONL file parsed as a JSON object, with its 1-based line number;
/// read a line at a time.
fn for_each_line(
    path: &Path,
    f: &mut dyn FnMut(At, Result<JsonObject>) -> Result<()>,
) -> Result<()> {
    let shown = path.display();
    let file =
        std::fs::File::open(path).map_err(|e| anyhow!("cannot read dataset {shown}: {e}"))?;
    let mut reader = BufReader::with_capacity(1 << 20, file);
    let mut line = Vec::new();
    for line_no in 1.. {
        line.clear();
        let n = reader
            .read_until(b'\n', &mut line)
            .map_err(|e| anyhow!("cannot read dataset {shown} at line {line_no}: {e}"))?;
        if n == 0 {
            break;
        }
        let mut text = line.as_slice();
        text = text.strip_suffix(b"\n").unwrap_or(text);
        text = text.strip_suffix(b"\r").unwrap_or(text);
        if line_no == 1 {
            // Windows editors start UTF-8 files with a byte-order mark.
            text = text.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(text);
        }
        if text.iter().all(|c| c.is_ascii_whitespace()) {
            continue;
        }
        f(At::Line(line_no), parse_object(text))?;
    }
    Ok(())
}

/// One line parsed as a JSON object. serde's own position is always "line 1" here, so only its
/// column is kept.
fn parse_object(line: &[u8]) -> Result<JsonObject> {
    let value: Value = serde_json::from_slice(line).map_err(|e| {
        let msg = e.to_string();
        let suffix = format!(" at line {} column {}", e.line(), e.column());
        let msg = msg.strip_suffix(&suffix).unwrap_or(&msg);
        anyhow!("malformed JSON at column {}: {msg}", e.column())
    })?;
    match value {
        Value::Object(obj) => Ok(obj),
        other => bail!("record is {}, expected a JSON object", json_kind(&other)),
    }
}

/// `a string`, `an array`, ... for messages.
pub fn json_kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn globs() {
        assert!(glob_match("*.parquet", "train-00000-of-00002.parquet"));
        assert!(glob_match("train-*-of-*.parquet", "train-00001-of-00002.parquet"));
        assert!(!glob_match("train-*.parquet", "test-00000.parquet"));
        assert!(glob_match("a?c", "abc"));
        assert!(!glob_match("a?c", "ac"));
        assert!(glob_match("*", ""));
        assert!(!glob_match("*.jsonl", "x.jsonl.bak"));
    }

    #[test]
    fn directories_and_globs_are_sorted() {
        let dir = tempfile::tempdir().unwrap();
        for n in ["b.parquet", "a.jsonl", "c.txt", "a.parquet"] {
            std::fs::write(dir.path().join(n), "").unwrap();
        }
        let names = |p: PathBuf| -> Result<Vec<String>> {
            let files = Source::from(p.as_path()).files()?;
            Ok(files.iter().map(|(p, _)| p.file_name().unwrap().to_string_lossy().into()).collect())
        };
        assert_eq!(names(dir.path().into()).unwrap(), ["a.jsonl", "a.parquet", "b.parquet"]);
        assert_eq!(names(dir.path().join("*.parquet")).unwrap(), ["a.parquet", "b.parquet"]);
        let err = names(dir.path().join("*.csv")).unwrap_err().to_string();
        assert!(err.contains("no .jsonl or .parquet file matches"), "{err}");
        // A file named by itself is read whatever its extension.
        assert_eq!(names(dir.path().join("c.txt")).unwrap(), ["c.txt"]);
    }

    #[test]
    fn columns_check_names_the_valid_keys() {
        let cols = Columns([("mesages".to_string(), "conv".to_string())].into());
        let err = cols.check("chat", &["messages", "role", "content"]).unwrap_err().to_string();
        assert!(err.starts_with("data.columns.mesages: not a field of the chat format"), "{err}");
        assert!(err.contains("(messages, role, content)"), "{err}");
        assert_eq!(cols.name("mesages"), "conv");
        assert_eq!(cols.name("messages"), "messages");
    }
}
