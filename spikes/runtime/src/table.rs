//! Summarises repeated runs into the markdown table of the spike report: the median of each
//! figure with its min-max, because the machine is shared and single runs are noisy.

use anyhow::{bail, Context};

/// One measured run, as run.sh writes it: runtime, configuration, repetition, then the client's
/// figures (IOPS, p50/p99/p99.9 in microseconds, server and client CPU in percent of one core,
/// hypervisor steal in percent of the machine).
struct Run {
    runtime: String,
    configuration: String,
    figures: [f64; FIGURES],
}

const FIGURES: usize = 7;
const IOPS: usize = 0;
const SERVER_CPU: usize = 4;

fn parse(results: &str) -> anyhow::Result<Vec<Run>> {
    let mut runs = Vec::new();
    for (index, line) in results.lines().enumerate().filter(|(_, line)| !line.trim().is_empty()) {
        let fields: Vec<&str> = line.split('\t').collect();
        if fields.len() != 3 + FIGURES {
            bail!("line {}: expected {} tab-separated fields: {line}", index + 1, 3 + FIGURES);
        }
        let mut figures = [0.0; FIGURES];
        for (figure, field) in figures.iter_mut().zip(&fields[3..]) {
            *figure = field.parse().with_context(|| format!("line {}: {field}", index + 1))?;
        }
        runs.push(Run {
            runtime: fields[0].to_string(),
            configuration: fields[1].to_string(),
            figures,
        });
    }
    Ok(runs)
}

/// Median, minimum and maximum.
fn spread(mut values: Vec<f64>) -> (f64, f64, f64) {
    assert!(!values.is_empty());
    values.sort_by(f64::total_cmp);
    let middle = values.len() / 2;
    let median = if values.len() % 2 == 1 {
        values[middle]
    } else {
        (values[middle - 1] + values[middle]) / 2.0
    };
    (median, values[0], values[values.len() - 1])
}

fn cell(values: Vec<f64>, decimals: usize) -> String {
    let (median, min, max) = spread(values);
    format!("{median:.decimals$} ({min:.decimals$}–{max:.decimals$})")
}

pub fn markdown(results: &str) -> anyhow::Result<String> {
    let runs = parse(results)?;
    let mut groups: Vec<(String, String)> = Vec::new();
    for run in &runs {
        let key = (run.configuration.clone(), run.runtime.clone());
        if !groups.contains(&key) {
            groups.push(key);
        }
    }
    let mut table = String::from(
        "| config | runtime | runs | IOPS | IOPS per server core | server CPU % | p50 µs | p99 µs \
         | p99.9 µs | client CPU % | steal % |\n|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for (configuration, runtime) in groups {
        let group: Vec<&Run> = runs
            .iter()
            .filter(|run| run.configuration == configuration && run.runtime == runtime)
            .collect();
        let column = |figure: usize| group.iter().map(|run| run.figures[figure]).collect();
        let per_core: Vec<f64> = group
            .iter()
            .map(|run| run.figures[IOPS] / (run.figures[SERVER_CPU] / 100.0).max(0.01))
            .collect();
        table.push_str(&format!(
            "| {configuration} | {runtime} | {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
            group.len(),
            cell(column(IOPS), 0),
            cell(per_core, 0),
            cell(column(SERVER_CPU), 0),
            cell(column(1), 1),
            cell(column(2), 1),
            cell(column(3), 1),
            cell(column(5), 0),
            cell(column(6), 1),
        ));
    }
    Ok(table)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medians_with_min_max() {
        assert_eq!(spread(vec![3.0, 1.0, 2.0]), (2.0, 1.0, 3.0));
        assert_eq!(spread(vec![4.0, 1.0]), (2.5, 1.0, 4.0));
        let results = "monoio\t4x32\t1\t100\t10\t20\t30\t50\t90\t1\n\
                       monoio\t4x32\t2\t300\t10\t20\t30\t100\t90\t2\n\
                       monoio\t4x32\t3\t200\t10\t20\t30\t100\t90\t3\n";
        let table = markdown(results).unwrap();
        assert!(
            table.contains("| 4x32 | monoio | 3 | 200 (100–300) | 200 (200–300) | 100 (50–100) |"),
            "{table}"
        );
        assert!(markdown("monoio\t4x32\t1\n").is_err());
    }
}
