//! A strided layout with as few dimensions as reach the same elements in the same order: the GPU
//! gradient kernel indexes a contiguous gradient linearly (no division per dimension per
//! element) when its layout merges to one dimension of stride 1, and divides by fewer
//! dimensions otherwise.

/// The dims and strides (outermost first, strides in elements) that visit the elements of the
/// layout `dims`/`strides` at the same offsets in the same row-major order, with dimensions of
/// size 1 dropped and each dimension merged into the one outside it where the outer stride is
/// the inner dimension's size times its stride. A contiguous layout becomes one dimension of
/// stride 1; a layout of one element or none becomes no dimension at all (an empty layout has
/// a dimension of size 0).
pub(crate) fn merged_layout(dims: &[usize], strides: &[usize]) -> (Vec<usize>, Vec<usize>) {
    if dims.contains(&0) {
        return (vec![0], vec![1]);
    }
    let mut merged: Vec<(usize, usize)> = Vec::with_capacity(dims.len());
    for (&dim, &stride) in dims.iter().zip(strides) {
        if dim == 1 {
            continue;
        }
        match merged.last_mut() {
            // The outer dimension steps over exactly one run of this one: they are one.
            Some((outer_dim, outer_stride)) if *outer_stride == dim * stride => {
                *outer_dim *= dim;
                *outer_stride = stride;
            }
            _ => merged.push((dim, stride)),
        }
    }
    merged.into_iter().unzip()
}

/// Whether a merged layout is one run of consecutive elements (or none, or one).
pub(crate) fn is_linear(dims: &[usize], strides: &[usize]) -> bool {
    match (dims, strides) {
        ([], []) => true,
        ([_], [stride]) => *stride == 1,
        ([0], _) => true,
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The element offsets of a layout in row-major order, by the definition: for each index
    /// tuple, the sum of index times stride.
    fn offsets(dims: &[usize], strides: &[usize]) -> Vec<usize> {
        let n: usize = dims.iter().product();
        (0..n)
            .map(|mut i| {
                let mut offset = 0;
                for d in (0..dims.len()).rev() {
                    offset += (i % dims[d]) * strides[d];
                    i /= dims[d];
                }
                offset
            })
            .collect()
    }

    /// Row-major strides of `dims`.
    fn contiguous(dims: &[usize]) -> Vec<usize> {
        let mut strides = vec![1; dims.len()];
        for d in (0..dims.len().saturating_sub(1)).rev() {
            strides[d] = strides[d + 1] * dims[d + 1];
        }
        strides
    }

    /// Every layout of up to 4 dimensions of sizes 1 to 3 that permuting, narrowing and
    /// broadcasting a contiguous tensor gives: the merged layout reaches the same offsets in the
    /// same order, and never has more dimensions.
    #[test]
    fn merging_keeps_every_offset_and_its_order() {
        let mut checked = 0;
        for rank in 0..=4usize {
            let sizes = [1usize, 2, 3];
            for code in 0..sizes.len().pow(rank as u32) {
                let dims: Vec<usize> = (0..rank)
                    .map(|d| sizes[code / sizes.len().pow(d as u32) % sizes.len()])
                    .collect();
                // Contiguous, each dimension padded (narrowed out of a wider base), reversed
                // (a transpose of the reversed dims), and one dimension broadcast (stride 0).
                let base = contiguous(&dims);
                let mut layouts = vec![base.clone()];
                layouts.push(base.iter().map(|s| s * 2).collect());
                let reversed: Vec<usize> =
                    contiguous(&dims.iter().rev().copied().collect::<Vec<_>>())
                        .into_iter()
                        .rev()
                        .collect();
                layouts.push(reversed);
                if rank > 0 {
                    let mut broadcast = base.clone();
                    broadcast[0] = 0;
                    layouts.push(broadcast);
                }
                for strides in layouts {
                    let (md, ms) = merged_layout(&dims, &strides);
                    assert_eq!(
                        offsets(&md, &ms),
                        offsets(&dims, &strides),
                        "{dims:?} / {strides:?} merged to {md:?} / {ms:?}"
                    );
                    assert!(md.len() <= rank.max(1), "{dims:?} / {strides:?}");
                    checked += 1;
                }
            }
        }
        assert!(checked > 300, "{checked} layouts");
    }

    /// A contiguous layout, with or without dimensions of size 1, is one linear run; transposed
    /// and narrowed ones are not, and a permutation that keeps two dimensions adjacent merges
    /// them.
    #[test]
    fn contiguous_layouts_become_one_linear_dimension() {
        for dims in [vec![4, 6], vec![2, 1, 3, 4], vec![7], vec![1, 1, 5]] {
            let (md, ms) = merged_layout(&dims, &contiguous(&dims));
            assert_eq!(
                (md.clone(), ms.clone()),
                (vec![dims.iter().product()], vec![1])
            );
            assert!(is_linear(&md, &ms));
        }
        // One element, and none.
        assert_eq!(merged_layout(&[1, 1], &[1, 1]), (vec![], vec![]));
        assert!(is_linear(&[], &[]));
        assert_eq!(merged_layout(&[3, 0], &[0, 1]), (vec![0], vec![1]));
        // A [4, 6] view of a transposed [6, 4]: stays two dimensions.
        let (md, ms) = merged_layout(&[4, 6], &[1, 4]);
        assert_eq!((md.as_slice(), ms.as_slice()), (&[4, 6][..], &[1, 4][..]));
        assert!(!is_linear(&md, &ms));
        // Narrowed columns: rows of 6 in rows of 8.
        assert!(!is_linear(&[4, 6], &[8, 1]));
        // [2, 3, 4] permuted to [4, 2, 3] (strides [1, 12, 4]): the last two merge.
        assert_eq!(
            merged_layout(&[4, 2, 3], &[1, 12, 4]),
            (vec![4, 6], vec![1, 4])
        );
    }
}
