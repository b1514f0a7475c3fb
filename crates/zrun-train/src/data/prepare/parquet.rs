//! Parquet inputs: one document per row, the text in the top-level string column named by
//! `--field` (`string`, `large_string` or `string_view`). Only that column is read, page by
//! page, in record batches of [`BATCH_ROWS`] rows, so memory stays near one batch of
//! documents whatever the file's size (Hugging Face datasets' Parquet files: snappy, zstd,
//! gzip or lz4 pages).

use arrow_array::cast::AsArray;
use arrow_array::Array;
use arrow_schema::DataType;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use parquet::arrow::ProjectionMask;

use super::super::DataError;
use super::batches::{Halt, Origin, Sink};
use super::error::PrepareError;
use super::inputs::Input;

/// Rows per record batch read.
const BATCH_ROWS: usize = 128;

/// Reads the documents of a Parquet file; a missing or non-string column, a null, or an
/// undecodable row group is an error, or counted and skipped with `skip_bad` (a bad column
/// skips the file, a bad row group the rest of it).
pub(super) fn read(
    input: &Input,
    index: u32,
    field: &str,
    skip_bad: bool,
    sink: &mut Sink,
) -> Result<(), Halt> {
    let path = &input.path;
    let file = crate::data::open_regular(path).map_err(|source| DataError::Io {
        key: "input",
        path: path.clone(),
        op: "read",
        source,
    })?;
    let unreadable = |at: String, e: &dyn std::fmt::Display| PrepareError::Unreadable {
        path: path.clone(),
        at,
        op: "read Parquet",
        problem: e
            .to_string()
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" "),
    };
    let builder = match ParquetRecordBatchReaderBuilder::try_new(file) {
        Ok(b) => b,
        Err(_) if skip_bad => {
            sink.skip();
            sink.add_bytes(input.bytes);
            return Ok(());
        }
        Err(e) => return Err(unreadable("the footer".into(), &e).into()),
    };
    let schema = builder.schema().clone();
    let column = match check_column(&schema, field) {
        Ok(i) => i,
        Err(_) if skip_bad => {
            sink.skip();
            sink.add_bytes(input.bytes);
            return Ok(());
        }
        Err(problem) => {
            let columns: Vec<String> = schema
                .fields()
                .iter()
                .map(|f| format!("{:?} {}", f.name(), f.data_type()))
                .collect();
            return Err(PrepareError::Column {
                path: path.clone(),
                problem,
                columns: if columns.is_empty() {
                    "none".into()
                } else {
                    columns.join(", ")
                },
            }
            .into());
        }
    };
    // Row group g holds rows ends[g - 1]..ends[g].
    let ends: Vec<u64> = builder
        .metadata()
        .row_groups()
        .iter()
        .scan(0u64, |end, rg| {
            *end += rg.num_rows().max(0) as u64;
            Some(*end)
        })
        .collect();
    let rows = ends.last().copied().unwrap_or(0);
    let group = |row: u64| ends.partition_point(|&e| e <= row);
    let mask = ProjectionMask::roots(builder.parquet_schema(), [column]);
    let reader = builder
        .with_projection(mask)
        .with_batch_size(BATCH_ROWS)
        .build()
        .map_err(|e| unreadable("the footer".into(), &e))?;
    let (mut row, mut counted) = (0u64, 0u64);
    for batch in reader {
        let batch = match batch {
            Ok(b) => b,
            Err(e) => {
                let g = group(row);
                let start = if g == 0 { 0 } else { ends[g - 1] };
                let at = format!(
                    "row group {g} (rows {start}..{})",
                    ends.get(g).unwrap_or(&rows)
                );
                if skip_bad {
                    sink.skip();
                    break;
                }
                return Err(unreadable(at, &e).into());
            }
        };
        let col = batch.column(0);
        for i in 0..col.len() {
            let text = if col.is_null(i) {
                None
            } else if let Some(a) = col.as_string_opt::<i32>() {
                Some(a.value(i))
            } else if let Some(a) = col.as_string_opt::<i64>() {
                Some(a.value(i))
            } else {
                col.as_string_view_opt().map(|a| a.value(i))
            };
            match text {
                Some(t) => sink.document(index, Origin::Row(row), t.to_owned())?,
                None if skip_bad => sink.skip(),
                None => {
                    return Err(PrepareError::Null {
                        path: path.clone(),
                        row,
                        row_group: group(row),
                        field: field.to_string(),
                    }
                    .into())
                }
            }
            row += 1;
        }
        // Progress: the file's bytes in proportion to the rows read.
        let done = (input.bytes as f64 * row as f64 / rows.max(1) as f64) as u64;
        sink.add_bytes(done.saturating_sub(counted));
        counted = done.max(counted);
    }
    sink.add_bytes(input.bytes.saturating_sub(counted));
    Ok(())
}

/// The position of `field` among the top-level columns, if it holds strings.
fn check_column(schema: &arrow_schema::Schema, field: &str) -> Result<usize, String> {
    let i = schema
        .fields()
        .iter()
        .position(|f| f.name() == field)
        .ok_or_else(|| format!("no column {field:?}"))?;
    match schema.field(i).data_type() {
        DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View => Ok(i),
        other => Err(format!("column {field:?} is {other}, not a string column")),
    }
}
