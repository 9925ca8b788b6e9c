//! How many GPUs the workers will see, without linking CUDA into the launcher: the machine's GPUs
//! as the driver lists them (`accelerate_core::physical_gpu_count`), narrowed by
//! `CUDA_VISIBLE_DEVICES` the way the CUDA runtime does.

/// GPUs visible to a worker started with this process's environment.
pub fn visible_gpu_count() -> usize {
    let physical = accelerate_core::physical_gpu_count();
    visible_count(
        physical,
        std::env::var("CUDA_VISIBLE_DEVICES").ok().as_deref(),
    )
}

/// The number of devices CUDA exposes for `CUDA_VISIBLE_DEVICES=visible` on a machine with
/// `physical` GPUs: entries up to the first invalid one (an index out of range, a repeated index,
/// or garbage) count; UUIDs (`GPU-...`, `MIG-...`) are taken on trust.
fn visible_count(physical: usize, visible: Option<&str>) -> usize {
    let Some(list) = visible else {
        return physical;
    };
    let mut seen = Vec::new();
    let mut count = 0;
    for entry in list.split(',').map(str::trim) {
        if entry.starts_with("GPU-") || entry.starts_with("MIG-") {
            count += 1;
            continue;
        }
        match entry.parse::<usize>() {
            Ok(i) if i < physical && !seen.contains(&i) => {
                seen.push(i);
                count += 1;
            }
            _ => break,
        }
    }
    count.min(physical)
}

#[cfg(test)]
mod tests {
    use super::visible_count;

    #[test]
    fn cuda_visible_devices_narrows_the_list_as_cuda_does() {
        assert_eq!(visible_count(4, None), 4);
        assert_eq!(visible_count(4, Some("")), 0);
        assert_eq!(visible_count(4, Some("2,3")), 2);
        // CUDA stops at the first invalid entry.
        assert_eq!(visible_count(4, Some("0,7,1")), 1);
        assert_eq!(visible_count(4, Some("1,1")), 1);
        assert_eq!(visible_count(4, Some("-1")), 0);
        assert_eq!(visible_count(2, Some("GPU-0a1b,GPU-2c3d")), 2);
        assert_eq!(visible_count(0, Some("0")), 0);
    }
}
