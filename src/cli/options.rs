//! `attnscope __options --json` (hidden): every subcommand and each of its options and
//! positional arguments, read from clap's own command tree, with what kind of value each takes.
//! `tests/option_sweep.rs` runs every option with bad values from this list, so a new option is
//! swept without anyone adding it to a table.

use super::common::emit;
use clap::builder::ArgAction;
use serde::Serialize;
use std::any::TypeId;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The list as JSON (the only output).
    #[arg(long)]
    json: bool,
}

/// One option (or positional argument) of a subcommand.
#[derive(Serialize)]
struct OptionInfo {
    /// `--name` without the dashes; the argument's id for a positional one
    name: String,
    positional: bool,
    /// `flag` (takes no value), `path`, `int`, `float`, `string`, `enum` (one of
    /// `possible_values`) or `other` (a type of attnscope's own, parsed from text)
    kind: &'static str,
    possible_values: Vec<String>,
    required: bool,
    /// whether it may be given more than once (or take several values)
    multiple: bool,
}

#[derive(Serialize)]
struct CommandInfo {
    /// the subcommand's words (`["corpus", "merge"]`)
    command: Vec<String>,
    options: Vec<OptionInfo>,
}

/// The kind of value `arg` takes, from its action and its parser's value type.
fn kind(arg: &clap::Arg) -> &'static str {
    if !arg.get_action().takes_values() {
        return "flag";
    }
    if !arg.get_possible_values().is_empty() {
        return "enum";
    }
    let t = arg.get_value_parser().type_id();
    let is = |ids: &[TypeId]| ids.iter().any(|id| t == *id);
    if is(&[TypeId::of::<std::path::PathBuf>()]) {
        "path"
    } else if is(&[
        TypeId::of::<u8>(),
        TypeId::of::<u16>(),
        TypeId::of::<u32>(),
        TypeId::of::<u64>(),
        TypeId::of::<usize>(),
        TypeId::of::<i32>(),
        TypeId::of::<i64>(),
    ]) {
        "int"
    } else if is(&[TypeId::of::<f32>(), TypeId::of::<f64>()]) {
        "float"
    } else if is(&[TypeId::of::<String>()]) {
        "string"
    } else {
        "other"
    }
}

fn option_info(arg: &clap::Arg) -> OptionInfo {
    let positional = arg.is_positional();
    OptionInfo {
        name: match arg.get_long() {
            Some(l) if !positional => l.to_string(),
            _ => arg.get_id().to_string(),
        },
        positional,
        kind: kind(arg),
        possible_values: arg
            .get_possible_values()
            .iter()
            .filter(|v| !v.is_hide_set())
            .map(|v| v.get_name().to_string())
            .collect(),
        required: arg.is_required_set(),
        multiple: matches!(arg.get_action(), ArgAction::Append)
            || arg.get_num_args().is_some_and(|n| n.max_values() > 1),
    }
}

/// `cmd` and its subcommands, depth first, each with its path of words from the top.
fn walk(cmd: &clap::Command, path: &[String], out: &mut Vec<CommandInfo>) {
    let options = cmd
        .get_arguments()
        .filter(|a| !matches!(a.get_action(), ArgAction::Help | ArgAction::Version))
        .map(option_info)
        .collect::<Vec<_>>();
    if !path.is_empty() && !path[0].starts_with("__") {
        out.push(CommandInfo {
            command: path.to_vec(),
            options,
        });
    }
    for sub in cmd.get_subcommands() {
        let mut p = path.to_vec();
        p.push(sub.get_name().to_string());
        walk(sub, &p, out);
    }
}

pub fn run(a: Args) -> anyhow::Result<()> {
    if !a.json {
        return Err(super::common::usage(
            "__options lists the commands' options as JSON: pass --json",
        ));
    }
    let mut out = Vec::new();
    walk(
        &<super::Cli as clap::CommandFactory>::command(),
        &[],
        &mut out,
    );
    emit(&format!("{}\n", serde_json::to_string_pretty(&out)?))
}
