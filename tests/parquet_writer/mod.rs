//! A small Parquet writer for the tests and the RSS benchmark (no Arrow): JSON records written
//! as the columns Hugging Face `datasets` (pyarrow) writes for them — strings, lists of integers,
//! lists of structs of strings — with snappy compression, one row group per call of
//! [`Writer::row_group`].

#![allow(dead_code)]

use std::fs::File;
use std::path::Path;
use std::sync::Arc;

use parquet::basic::Compression;
use parquet::data_type::{ByteArray, ByteArrayType, Int64Type};
use parquet::file::properties::WriterProperties;
use parquet::file::writer::SerializedFileWriter;
use parquet::schema::parser::parse_message_type;
use serde_json::{Map, Value};

/// One column of the file.
#[derive(Clone, Debug)]
pub enum Col {
    /// `optional binary (UTF8)`.
    Str(&'static str),
    /// `list<int64>` (three-level LIST).
    Ints(&'static str),
    /// `list<struct<k1: string, k2: string, ...>>`.
    Structs(&'static str, &'static [&'static str]),
}

impl Col {
    fn schema(&self) -> String {
        match self {
            Col::Str(n) => format!("OPTIONAL BYTE_ARRAY {n} (UTF8);"),
            Col::Ints(n) => format!(
                "OPTIONAL group {n} (LIST) {{ REPEATED group list {{ OPTIONAL INT64 element; }} }}"
            ),
            Col::Structs(n, keys) => {
                let leaves: String =
                    keys.iter().map(|k| format!("OPTIONAL BYTE_ARRAY {k} (UTF8); ")).collect();
                format!(
                    "OPTIONAL group {n} (LIST) {{ REPEATED group list {{ OPTIONAL group element \
                     {{ {leaves}}} }} }}"
                )
            }
        }
    }
}

pub struct Writer {
    cols: Vec<Col>,
    inner: SerializedFileWriter<File>,
}

impl Writer {
    pub fn create(path: &Path, cols: &[Col]) -> Writer {
        let body: String = cols.iter().map(|c| c.schema() + " ").collect();
        let schema = Arc::new(parse_message_type(&format!("message schema {{ {body}}}")).unwrap());
        let props =
            Arc::new(WriterProperties::builder().set_compression(Compression::SNAPPY).build());
        let inner = SerializedFileWriter::new(File::create(path).unwrap(), schema, props).unwrap();
        Writer { cols: cols.to_vec(), inner }
    }

    /// Writes `records` as one row group (a missing or null field is a null).
    pub fn row_group(&mut self, records: &[Map<String, Value>]) {
        let mut rg = self.inner.next_row_group().unwrap();
        for col in &self.cols {
            let leaves: Vec<Option<&str>> = match col {
                Col::Str(_) | Col::Ints(_) => vec![None],
                Col::Structs(_, keys) => keys.iter().map(|k| Some(*k)).collect(),
            };
            for leaf in leaves {
                let mut w = rg.next_column().unwrap().unwrap();
                let (mut defs, mut reps) = (Vec::new(), Vec::new());
                match col {
                    Col::Str(n) => {
                        let mut vals = Vec::new();
                        for r in records {
                            match r.get(*n).and_then(Value::as_str) {
                                Some(s) => {
                                    defs.push(1);
                                    vals.push(ByteArray::from(s));
                                }
                                None => defs.push(0),
                            }
                        }
                        w.typed::<ByteArrayType>().write_batch(&vals, Some(&defs), None).unwrap();
                    }
                    Col::Ints(n) => {
                        let mut vals = Vec::new();
                        for r in records {
                            list_levels(r.get(*n), 3, &mut defs, &mut reps, |v| {
                                vals.push(v.as_i64().unwrap());
                                true
                            });
                        }
                        w.typed::<Int64Type>()
                            .write_batch(&vals, Some(&defs), Some(&reps))
                            .unwrap();
                    }
                    Col::Structs(n, _) => {
                        let key = leaf.unwrap();
                        let mut vals = Vec::new();
                        for r in records {
                            list_levels(r.get(*n), 4, &mut defs, &mut reps, |v| {
                                match v.get(key).and_then(Value::as_str) {
                                    Some(s) => {
                                        vals.push(ByteArray::from(s));
                                        true
                                    }
                                    None => false,
                                }
                            });
                        }
                        w.typed::<ByteArrayType>()
                            .write_batch(&vals, Some(&defs), Some(&reps))
                            .unwrap();
                    }
                }
                w.close().unwrap();
            }
        }
        rg.close().unwrap();
    }

    pub fn close(self) {
        self.inner.close().unwrap();
    }
}

/// Definition and repetition levels of one row's optional list `v` whose leaf has definition
/// level `max_def` when present; `push` records an element's value and says whether it had one.
fn list_levels(
    v: Option<&Value>,
    max_def: i16,
    defs: &mut Vec<i16>,
    reps: &mut Vec<i16>,
    mut push: impl FnMut(&Value) -> bool,
) {
    match v.and_then(Value::as_array) {
        None => {
            defs.push(0);
            reps.push(0);
        }
        Some(items) if items.is_empty() => {
            defs.push(1);
            reps.push(0);
        }
        Some(items) => {
            for (i, item) in items.iter().enumerate() {
                reps.push(i16::from(i > 0));
                defs.push(if push(item) { max_def } else { max_def - 1 });
            }
        }
    }
}

/// Writes `records` to `path` in row groups of `group_rows`.
pub fn write(path: &Path, cols: &[Col], records: &[Map<String, Value>], group_rows: usize) {
    let mut w = Writer::create(path, cols);
    for chunk in records.chunks(group_rows) {
        w.row_group(chunk);
    }
    w.close();
}
