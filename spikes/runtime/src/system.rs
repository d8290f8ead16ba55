//! Operating-system helpers for a fair measurement: pinning a process to one CPU and reading
//! how much CPU time a process used, so throughput can be normalised per server core.

use std::io;

use anyhow::{bail, Context};

/// Pins the calling thread to `cpu`. Threads created afterwards inherit the mask, so calling
/// this first thing in `main` pins the whole process (runtime workers included).
pub fn pin_to_cpu(cpu: usize) -> anyhow::Result<()> {
    // SAFETY: cpu_set_t is a plain bit array; all zeroes is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: CPU_SET writes one bit inside `set`, and `cpu` is checked against its size.
    unsafe {
        assert!(cpu < 8 * std::mem::size_of::<libc::cpu_set_t>());
        libc::CPU_SET(cpu, &mut set);
    }
    // SAFETY: pid 0 is the calling thread; `set` is a valid cpu_set_t of the size passed.
    let result = unsafe { libc::sched_setaffinity(0, std::mem::size_of_val(&set), &set) };
    if result != 0 {
        return Err(io::Error::last_os_error()).context(format!("pin to CPU {cpu}"));
    }
    Ok(())
}

/// User plus system CPU time of process `pid` so far, in seconds, from /proc/<pid>/stat.
pub fn process_cpu_seconds(pid: u32) -> anyhow::Result<f64> {
    let path = format!("/proc/{pid}/stat");
    let stat = std::fs::read_to_string(&path).with_context(|| format!("read {path}"))?;
    // The command name is in parentheses and may contain spaces: fields count after the ')'.
    let Some((_, after_name)) = stat.rsplit_once(')') else { bail!("{path}: no ')' in {stat}") };
    let fields: Vec<&str> = after_name.split_whitespace().collect();
    // Fields 14 (utime) and 15 (stime) of proc(5); field 3 (state) is index 0 here.
    let (Some(user), Some(system)) = (fields.get(11), fields.get(12)) else {
        bail!("{path}: too few fields");
    };
    let ticks: u64 = user.parse::<u64>()? + system.parse::<u64>()?;
    Ok(ticks as f64 / ticks_per_second()?)
}

/// Time the hypervisor ran something else while this machine's CPUs wanted to run ("steal"),
/// summed over all CPUs, in seconds since boot, from the first line of /proc/stat.
pub fn steal_seconds() -> anyhow::Result<f64> {
    let stat = std::fs::read_to_string("/proc/stat").context("read /proc/stat")?;
    let Some(total) = stat.lines().next() else { bail!("/proc/stat is empty") };
    // cpu user nice system idle iowait irq softirq steal ...
    let Some(steal) = total.split_whitespace().nth(8) else { bail!("/proc/stat: no steal field") };
    Ok(steal.parse::<u64>()? as f64 / ticks_per_second()?)
}

/// CPUs online, to express steal as a share of the machine.
pub fn cpus_online() -> usize {
    // SAFETY: sysconf has no preconditions.
    let cpus = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
    usize::try_from(cpus).unwrap_or(1).max(1)
}

fn ticks_per_second() -> anyhow::Result<f64> {
    // SAFETY: sysconf has no preconditions.
    let ticks_per_second = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if ticks_per_second <= 0 {
        bail!("sysconf(_SC_CLK_TCK) failed");
    }
    Ok(ticks_per_second as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_cpu_time_grows_when_spinning() {
        let before = process_cpu_seconds(std::process::id()).unwrap();
        let start = std::time::Instant::now();
        let mut spin = 0u64;
        while start.elapsed().as_millis() < 100 {
            spin = std::hint::black_box(spin.wrapping_add(1));
        }
        let after = process_cpu_seconds(std::process::id()).unwrap();
        assert!(after - before >= 0.05, "before {before} after {after}");
    }

    #[test]
    fn steal_is_readable_and_monotonic() {
        let before = steal_seconds().unwrap();
        let after = steal_seconds().unwrap();
        assert!(before >= 0.0 && after >= before);
        assert!(cpus_online() >= 1);
    }
}
