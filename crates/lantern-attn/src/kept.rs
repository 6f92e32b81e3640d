//! Query rows a capture keeps on the backend's device between steps
//! ([`AttentionBackend::keep_rows`](crate::AttentionBackend::keep_rows)).
//!
//! A capturing request's query rows are read twice: once as its steps run, once when
//! its maps are computed. A backend whose tensors live on a device can keep them there:
//! each capturing step then copies the request's rows from the step's q into the
//! request's own rows on the device ([`KeptRows::write`]), nothing crosses to the host,
//! and the maps are computed where both the rows and the keys already are
//! ([`crate::ProbabilityMapJob`] with [`MapQueries::Kept`]). The host reads them
//! ([`KeptRows::read`]) only where it computes something itself.

use std::any::Any;
use std::fmt::Debug;
use std::ops::Range;

use crate::error::AttnError;

/// One captured layer's query rows of one request, `[capacity, row_len]` f32 on the
/// backend's device: row `i` is the request's `i`-th kept position, its asked heads one
/// after another.
pub trait KeptRows: Send + Sync + Debug {
    /// Values per row: the asked heads times the head dimension.
    fn row_len(&self) -> usize;

    /// Rows it holds room for.
    fn capacity(&self) -> usize;

    /// Copies tokens `tokens` of a step's `q` (the backend's own device tensor, `[step
    /// tokens, heads.num_heads, heads.head_dim]`), the heads `heads.kept` of each, into
    /// rows `first_row..`. Errors when `q` is not the backend's tensor or a range falls
    /// outside either.
    fn write(
        &mut self,
        q: &dyn Any,
        tokens: Range<usize>,
        heads: KeptHeads<'_>,
        first_row: usize,
    ) -> Result<(), AttnError>;

    /// Rows `rows`, copied to the host: `[rows.len(), row_len]`.
    fn read(&self, rows: Range<usize>) -> Result<Vec<f32>, AttnError>;

    /// For the backend that made it to get its own type back.
    fn as_any(&self) -> &dyn Any;
}

/// Which heads of a step's q a kept row holds.
#[derive(Debug, Clone, Copy)]
pub struct KeptHeads<'a> {
    /// Query heads of each token of the step's q.
    pub num_heads: usize,
    /// Those kept, in the row's order.
    pub kept: &'a [usize],
    pub head_dim: usize,
}

/// Where a [`crate::ProbabilityMapJob`]'s query rows are.
#[derive(Debug, Clone, Copy)]
pub enum MapQueries<'a> {
    /// On the host: `[rows, heads, head_dim]`.
    Host(&'a [f32]),
    /// Kept on a backend's device: the job's rows are `rows`' rows `first..`.
    Kept {
        rows: &'a dyn KeptRows,
        first: usize,
    },
}

impl MapQueries<'_> {
    /// Values of `n` rows of `row_len` they hold, or why not.
    pub(crate) fn check(&self, n: usize, row_len: usize) -> Result<(), AttnError> {
        match *self {
            Self::Host(q) if q.len() != n * row_len => Err(AttnError::LengthMismatch {
                what: "probability map queries",
                expected: n * row_len,
                got: q.len(),
            }),
            Self::Kept { rows, .. } if rows.row_len() != row_len => {
                Err(AttnError::LengthMismatch {
                    what: "kept query rows' values per row",
                    expected: row_len,
                    got: rows.row_len(),
                })
            }
            Self::Kept { rows, first } if first + n > rows.capacity() => {
                Err(AttnError::Unsupported(format!(
                    "probability map of kept query rows {first}..{} of {}",
                    first + n,
                    rows.capacity()
                )))
            }
            _ => Ok(()),
        }
    }
}
