//! Parquet files as dataset records: row group by row group, only the columns a format reads,
//! each row converted to the JSON object a JSONL line of the same data would be (nested lists
//! and structs included: `list<struct<role, content>>` is an array of objects).
//!
//! The file is read through the `parquet` crate's row API: one row group's pages are decoded
//! as its rows are consumed, so memory does not grow with the file.

use std::fs::File;
use std::path::Path;
use std::sync::Arc;

use anyhow::{Result, anyhow, bail};
use parquet::file::reader::{FileReader, SerializedFileReader};
use parquet::record::{Field, Row};
use parquet::schema::types::Type;
use serde_json::{Number, Value};

use super::source::{At, JsonObject, WantedColumns};

/// Calls `f` on every row of the Parquet file at `path` (its location, and the row as a JSON
/// object of the `wanted` columns), in file order. Errors name the file (and the row group).
pub fn for_each_row(
    path: &Path,
    wanted: &WantedColumns,
    f: &mut dyn FnMut(At, Result<JsonObject>) -> Result<()>,
) -> Result<()> {
    let shown = path.display();
    let file = File::open(path).map_err(|e| anyhow!("cannot read dataset {shown}: {e}"))?;
    let reader = SerializedFileReader::new(file)
        .map_err(|e| anyhow!("{shown}: not a readable Parquet file: {e}"))?;
    let projection = projection(reader.metadata().file_metadata().schema(), wanted)
        .map_err(|e| anyhow!("{shown}: {e}"))?;
    let mut row = 0;
    for group in 0..reader.num_row_groups() {
        let in_group = |e: parquet::errors::ParquetError| {
            anyhow!("{shown}: row group {group}: {}", codec_hint(&e.to_string()))
        };
        let rg = reader.get_row_group(group).map_err(in_group)?;
        let rows = rg.get_row_iter(Some(projection.clone())).map_err(in_group)?;
        for r in rows {
            let r = r.map_err(|e| {
                anyhow!("{shown}: row {row} (row group {group}): {}", codec_hint(&e.to_string()))
            })?;
            f(At::Row { row, group }, row_object(&r))?;
            row += 1;
        }
    }
    Ok(())
}

/// A read error, with a hint when it comes from a compression codec this build leaves out.
fn codec_hint(msg: &str) -> String {
    if msg.contains("Disabled feature") || msg.contains("not supported") {
        format!(
            "{msg}\nhint: Horizon reads Parquet compressed with snappy, gzip, lz4 or none; \
             rewrite the file with one of them (e.g. pyarrow.parquet.write_table(t, path, \
             compression=\"snappy\"))"
        )
    } else {
        msg.to_string()
    }
}

/// The file's schema cut to the top-level columns `wanted` names that it has; an error naming
/// a missing required column and the columns the file has.
fn projection(schema: &Type, wanted: &WantedColumns) -> Result<Type> {
    let fields = schema.get_fields();
    let has = |name: &str| fields.iter().any(|f| f.name() == name);
    for (field, column) in &wanted.required {
        if !has(column) {
            let names: Vec<&str> = fields.iter().map(|f| f.name()).collect();
            let hint = if field == column {
                format!("hint: name the column holding the {field} with data.columns.{field}")
            } else {
                format!("hint: data.columns.{field} = {column} names no column of this file")
            };
            bail!("no column \"{column}\" (the file has: {})\n{hint}", names.join(", "));
        }
    }
    let keep = |f: &&Arc<Type>| {
        wanted.required.iter().any(|(_, c)| c == f.name())
            || wanted.optional.iter().any(|c| c == f.name())
    };
    let kept: Vec<Arc<Type>> = fields.iter().filter(keep).cloned().collect();
    Ok(Type::group_type_builder(schema.name()).with_fields(kept).build()?)
}

/// A Parquet row as a JSON object.
fn row_object(row: &Row) -> Result<JsonObject> {
    row.get_column_iter()
        .map(|(name, field)| {
            let v = field_value(field).map_err(|e| anyhow!("column \"{name}\": {e}"))?;
            Ok((name.clone(), v))
        })
        .collect()
}

/// A Parquet value as JSON: numbers, strings (binary must be UTF-8), lists as arrays, structs
/// and maps with string keys as objects; dates and times as their display strings.
fn field_value(field: &Field) -> Result<Value> {
    let num = |n: Option<Number>| n.map_or(Value::Null, Value::Number);
    Ok(match field {
        Field::Null => Value::Null,
        Field::Bool(b) => Value::Bool(*b),
        Field::Byte(n) => Value::from(*n),
        Field::Short(n) => Value::from(*n),
        Field::Int(n) => Value::from(*n),
        Field::Long(n) => Value::from(*n),
        Field::UByte(n) => Value::from(*n),
        Field::UShort(n) => Value::from(*n),
        Field::UInt(n) => Value::from(*n),
        Field::ULong(n) => Value::from(*n),
        Field::Float16(x) => num(Number::from_f64(f64::from(*x))),
        Field::Float(x) => num(Number::from_f64(f64::from(*x))),
        Field::Double(x) => num(Number::from_f64(*x)),
        Field::Str(s) => Value::String(s.clone()),
        Field::Bytes(b) => match std::str::from_utf8(b.data()) {
            Ok(s) => Value::String(s.to_string()),
            Err(e) => bail!("a binary value that is not UTF-8 text ({e})"),
        },
        Field::Group(row) => Value::Object(row_object(row)?),
        Field::ListInternal(list) => {
            Value::Array(list.elements().iter().map(field_value).collect::<Result<_>>()?)
        }
        Field::MapInternal(map) => {
            let mut obj = JsonObject::new();
            for (k, v) in map.entries() {
                let Field::Str(k) = k else {
                    bail!("a map whose keys are not strings");
                };
                obj.insert(k.clone(), field_value(v)?);
            }
            Value::Object(obj)
        }
        other => Value::String(other.to_string()),
    })
}
