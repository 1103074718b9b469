//! Helpers shared by the worker integration tests.
#![allow(dead_code)]

pub mod llama_cpp_fixture;
#[path = "../../../tests/support/default_model.rs"]
pub mod model_path;
pub mod reference;
pub mod synthetic;
