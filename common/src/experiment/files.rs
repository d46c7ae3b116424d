//! The names a training run writes, in one place: the run's name, and every file and folder it
//! names itself from its flags. The writers take their names from the same functions, and
//! [`check`] looks at all of them before the data are read, so that a folder at `<run>.json` or
//! a FIFO at `<run>.safetensors` is said before the first step, not after the last one (whose
//! results would be lost).
use std::path::PathBuf;

use anyhow::Result;
use tch::Device;

use super::Experiment;
use crate::flags::RunArgs;
use crate::output::{self, Kind};

/// `<exercise>-<model>-<device>`: the stem of every file of a run on `device`.
pub(crate) fn run_name<E: Experiment>(exp: &E, device: Device) -> String {
    crate::report::run_name(exp.preset().name, &exp.model_name(), crate::device::device_name(device))
}

/// How a run writes a name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Way {
    /// Replaced whole ([`output::write`]): a link there is replaced, never followed.
    Replaced,
    /// Appended to ([`output::append`]): a link there is refused.
    Appended,
    /// A folder the run makes ([`output::folder`]).
    Folder,
}

/// Every name a run of `name` writes, as its flags ask, with how it writes it.
fn names(run: &RunArgs, exercise: &str, name: &str, model: &str) -> Vec<(PathBuf, Way)> {
    let results = &run.results_dir;
    let mut names = vec![
        (crate::report::results_path(results, name), Way::Replaced),
        (crate::report::config_path(results, name), Way::Replaced),
        (crate::report::table_path(results, exercise), Way::Appended),
        (crate::plots::curves_path_of(results, name), Way::Replaced),
        (crate::plots::devices_path_of(results, exercise, model), Way::Replaced),
    ];
    if run.eval_only {
        names.push((crate::report::eval_only_path(results, name), Way::Replaced));
    }
    if let Some((dir, _, _)) = checkpoint_config(run) {
        let file = crate::checkpoint::path_for(&dir, name);
        names.push((crate::checkpoint::previous_path(&file), Way::Replaced));
        names.push((crate::checkpoint::sharded::run_folder_of(&file), Way::Folder));
        names.push((file, Way::Replaced));
    }
    if let Some(dir) = &run.tensorboard {
        names.push((dir.join(name), Way::Folder));
    }
    if run.profiling().is_some() {
        let trace = run.trace_path(name, "trace", None);
        names.push((crate::profile::table_path(&trace), Way::Replaced));
        names.push((trace, Way::Replaced));
        names.push((run.trace_path(name, "torch-trace", None), Way::Replaced));
    }
    names
}

/// Looks at every name a run of `exp` on each of `devices` would write: a usage error naming
/// the first that cannot be written as the run would write it.
pub(crate) fn check<E: Experiment>(exp: &E, devices: &[Device]) -> Result<()> {
    let run = exp.run_args();
    for &device in devices {
        for (path, way) in names(run, exp.preset().name, &run_name(exp, device), &exp.model_name()) {
            match way {
                Way::Replaced => output::check_file(&path)?,
                Way::Folder => output::check_folder(&path)?,
                Way::Appended => {
                    // A link planted at an appended file's name would make the run grow any
                    // file its user can write.
                    if Kind::of(&path)? == Kind::Link {
                        return crate::error::usage(format!(
                            "{} is a symbolic link: not writing through it (remove it, or choose another --results-dir)",
                            path.display()
                        ));
                    }
                    output::check_file(&path)?;
                }
            }
        }
    }
    Ok(())
}

/// Where a run's checkpoints go and what it starts from: (folder, resume, a file to start from)
/// for --checkpoint-dir, --resume and --eval-only's --checkpoint FILE.
pub(super) fn checkpoint_config(run: &RunArgs) -> Option<(std::path::PathBuf, bool, Option<std::path::PathBuf>)> {
    match (&run.checkpoint, &run.checkpoint_dir) {
        (Some(file), dir) => {
            let beside = file.parent().map(std::path::Path::to_path_buf).unwrap_or_default();
            Some((dir.clone().unwrap_or(beside), true, Some(file.clone())))
        }
        (None, Some(dir)) => Some((dir.clone(), run.resume, None)),
        (None, None) => None,
    }
}
