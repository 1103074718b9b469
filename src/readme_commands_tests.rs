//! The README's two commands and CI agree: the README's first ```sh block runs Tessera
//! (`scripts/tessera serve ...`) and then the tests (`scripts/test`), and `.ci/run` ends by
//! running that same test command, so what CI runs is what the README tells a user to run.

use std::path::Path;

fn read(rel: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(rel);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The lines of the README's first ```sh block.
fn readme_commands(readme: &str) -> Vec<&str> {
    readme.lines().skip_while(|l| !l.starts_with("```sh")).skip(1).take_while(|l| !l.starts_with("```")).collect()
}

/// The last line of a shell script that is a command (not blank, not a comment).
fn last_command(script: &str) -> Option<&str> {
    script.lines().map(str::trim).rfind(|l| !l.is_empty() && !l.starts_with('#'))
}

#[test]
fn ci_runs_the_readmes_test_command() {
    let readme = read("README.md");
    let commands = readme_commands(&readme);
    assert_eq!(commands.len(), 2, "the README's first sh block: {commands:?}");
    assert!(commands[0].starts_with("scripts/tessera serve"), "first command: {}", commands[0]);
    let ci = read(".ci/run");
    assert_eq!(last_command(&ci), Some(commands[1]), ".ci/run must end by running the README's test command");
}

#[test]
fn the_helpers_read_what_they_should() {
    let readme = "# T\n\n```sh\na b\nc\n```\n\n```sh\nd\n```\n";
    assert_eq!(readme_commands(readme), ["a b", "c"]);
    assert_eq!(last_command("#!/bin/sh\nset -e\nx y\n# done\n\n"), Some("x y"));
}
