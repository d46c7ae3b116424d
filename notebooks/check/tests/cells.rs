//! Every notebook's code cells, compiled as one function each (see build.rs): this test target
//! does not build when a notebook no longer compiles against `common`, so neither does `make
//! test`. The functions are never called; `make notebooks` runs the cells in the evcxr kernel.
use std::path::Path;

/// What a cell's `?` may return: any error that displays, as evcxr's `EvcxrUserCodeError`.
/// (Not `Display` itself, so that the blanket `From` does not overlap `From<T> for T`.)
#[derive(Debug)]
pub struct CellError(pub String);

impl<E: std::fmt::Display> From<E> for CellError {
    fn from(error: E) -> Self {
        CellError(error.to_string())
    }
}

include!(concat!(env!("OUT_DIR"), "/notebooks.rs"));

#[test]
fn every_code_cell_of_every_notebook_is_compiled() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let mut on_disk: Vec<(String, usize)> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "ipynb"))
        .map(|p| {
            let nb: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
            let code = nb["cells"].as_array().unwrap().iter().filter(|c| c["cell_type"] == "code").count();
            (p.file_name().unwrap().to_string_lossy().into_owned(), code)
        })
        .collect();
    on_disk.sort();
    let compiled: Vec<(String, usize)> = NOTEBOOKS.iter().map(|(n, c)| (n.to_string(), *c)).collect();
    assert_eq!(compiled, on_disk, "the notebooks compiled here are the ones in notebooks/, every code cell of each");
    assert!(compiled.len() >= 4 && compiled.iter().all(|(_, cells)| *cells > 0));
}
