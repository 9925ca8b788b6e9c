//! Which parameters make up each sharded unit, and which elements of a unit each rank keeps.
//!
//! A unit's parameters (sorted by name within the unit) are laid end to end in one flat buffer,
//! padded to a multiple of the world size, and rank `r` keeps block `r` of it: PyTorch FSDP's
//! flat parameter, cut by the same [`ShardPlan`] as ZeRO stages 1 and 2, with one "bucket" per
//! unit. Units need not be contiguous in sorted-name order (Llama's head unit holds `lm_head.*`
//! and `model.norm.*`), so the plan is cut over the parameters in unit order, and the layout
//! maps between that order and the sorted one.

use candle_core::Shape;

use crate::error::{Error, Result};
use crate::zero::ShardPlan;

/// One unit of a fully sharded model: a name, and the parameters it holds, given by name prefix
/// (Accelerate's `TRANSFORMER_BASED_WRAP` wraps each instance of a layer class; here each
/// instance is named by the prefix of its parameters, e.g. `h.3.` for GPT-2's fourth block).
///
/// A prefix ending in `.` takes every parameter whose name starts with it; a prefix without the
/// dot takes the parameter of exactly that name and every one under `prefix.`, so `h.1` never
/// takes `h.10.*`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnitSpec {
    name: String,
    prefixes: Vec<String>,
}

impl UnitSpec {
    /// A unit called `name` holding the parameters under `prefixes`.
    pub fn new<P: Into<String>>(
        name: impl Into<String>,
        prefixes: impl IntoIterator<Item = P>,
    ) -> Self {
        Self {
            name: name.into(),
            prefixes: prefixes.into_iter().map(Into::into).collect(),
        }
    }

    /// The unit's name (what [`PreparedModel::unit`](crate::PreparedModel::unit) takes).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Whether parameter `param` belongs to this unit.
    pub fn holds(&self, param: &str) -> bool {
        self.prefixes.iter().any(|p| {
            if p.ends_with('.') {
                param.starts_with(p.as_str())
            } else {
                param == p || (param.starts_with(p.as_str()) && param[p.len()..].starts_with('.'))
            }
        })
    }
}

/// One unit as laid out: its parameters (indices into the sorted parameter list, in order).
#[derive(Debug, Clone)]
pub(crate) struct Unit {
    pub name: String,
    pub params: Vec<usize>,
}

/// The units of a model and their partition over the ranks.
#[derive(Debug, Clone)]
pub(crate) struct UnitLayout {
    units: Vec<Unit>,
    /// Per parameter (sorted index): its unit.
    unit_of: Vec<usize>,
    /// Per parameter (sorted index): its position in unit order, which the plan indexes.
    position: Vec<usize>,
    /// Per parameter (sorted index): its shape.
    shapes: Vec<Shape>,
    plan: ShardPlan,
}

impl UnitLayout {
    /// Lays out `params` (sorted by name: names and shapes) as `specs` group them, over `world`
    /// ranks. Every parameter must belong to exactly one unit and every unit hold one.
    pub fn new(params: &[(String, Shape)], specs: &[UnitSpec], world: usize) -> Result<Self> {
        if specs.is_empty() {
            return Err(Error::Config(
                "the model declares no units; list them with Model::units (one per \
                 transformer block, one for the embeddings, one for the head)"
                    .into(),
            ));
        }
        for (i, spec) in specs.iter().enumerate() {
            if specs[..i].iter().any(|s| s.name == spec.name) {
                return Err(Error::Config(format!(
                    "two units are named {:?}; give each unit its own name",
                    spec.name
                )));
            }
        }
        let mut unit_of = Vec::with_capacity(params.len());
        let mut unmatched = Vec::new();
        for (name, _) in params {
            let holders: Vec<usize> = (0..specs.len()).filter(|&u| specs[u].holds(name)).collect();
            match holders.as_slice() {
                [u] => unit_of.push(*u),
                [] => {
                    unmatched.push(name.as_str());
                    unit_of.push(usize::MAX);
                }
                [a, b, ..] => {
                    return Err(Error::Config(format!(
                        "parameter {name:?} belongs to two units, {:?} and {:?}; each parameter \
                         must be in exactly one unit (end a prefix with '.' to stop `h.1` from \
                         taking `h.10`)",
                        specs[*a].name, specs[*b].name
                    )))
                }
            }
        }
        if !unmatched.is_empty() {
            let shown: Vec<&str> = unmatched.iter().take(8).copied().collect();
            return Err(Error::Config(format!(
                "{} parameters belong to no unit (e.g. {shown:?}); every parameter must be in \
                 exactly one unit: add a unit for them to Model::units",
                unmatched.len()
            )));
        }
        let mut units: Vec<Unit> = specs
            .iter()
            .map(|s| Unit {
                name: s.name.clone(),
                params: Vec::new(),
            })
            .collect();
        for (p, &u) in unit_of.iter().enumerate() {
            units[u].params.push(p);
        }
        if let Some(empty) = units.iter().find(|u| u.params.is_empty()) {
            return Err(Error::Config(format!(
                "unit {:?} holds no parameter; its prefixes match none of the model's names",
                empty.name
            )));
        }
        let mut position = vec![0; params.len()];
        let mut buckets = Vec::with_capacity(units.len());
        let mut next = 0;
        for unit in &units {
            let start = next;
            let mut lens = Vec::with_capacity(unit.params.len());
            for &p in &unit.params {
                position[p] = next;
                next += 1;
                lens.push(params[p].1.elem_count());
            }
            buckets.push((start..next, lens));
        }
        Ok(Self {
            units,
            unit_of,
            position,
            shapes: params.iter().map(|(_, s)| s.clone()).collect(),
            plan: ShardPlan::new(&buckets, world),
        })
    }

    /// The units, in declaration order.
    pub fn units(&self) -> &[Unit] {
        &self.units
    }

    /// The index of the unit called `name`.
    pub fn find(&self, name: &str) -> Result<usize> {
        self.units
            .iter()
            .position(|u| u.name == name)
            .ok_or_else(|| {
                let names: Vec<&str> = self.units.iter().map(|u| u.name.as_str()).collect();
                Error::Config(format!(
                    "the model has no unit {name:?}; its units are {names:?}"
                ))
            })
    }

    /// The unit of parameter `p` (sorted index).
    pub fn unit_of(&self, p: usize) -> usize {
        self.unit_of[p]
    }

    /// The shape of parameter `p`.
    pub fn shape(&self, p: usize) -> &Shape {
        &self.shapes[p]
    }

    /// Where parameter `p` starts in its unit's flat buffer.
    pub fn offset(&self, p: usize) -> usize {
        self.plan.position(self.position[p]).1
    }

    /// The elements of parameter `p` (flattened) that `rank` keeps, if any.
    pub fn piece(&self, p: usize, rank: usize) -> Option<std::ops::Range<usize>> {
        self.plan.piece(self.position[p], rank)
    }

    /// Elements per rank of unit `u`'s flat buffer (its padded length is `world` times this).
    pub fn block(&self, u: usize) -> usize {
        self.plan.block(u)
    }

    /// The padded length of unit `u`'s flat buffer.
    pub fn padded_len(&self, u: usize) -> usize {
        self.plan.padded_len(u)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(list: &[(&str, &[usize])]) -> Vec<(String, Shape)> {
        let mut v: Vec<(String, Shape)> = list
            .iter()
            .map(|(n, s)| (n.to_string(), Shape::from(s.to_vec())))
            .collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    }

    /// Llama's layout: the head unit (`lm_head`, `model.norm`) is split by the layers in sorted
    /// order; every element of every parameter is kept by exactly one rank, at the offset the
    /// unit's flat buffer gives it.
    #[test]
    fn pieces_tile_units_that_are_not_contiguous_in_name_order() {
        let p = params(&[
            ("lm_head.weight", &[5, 3]),
            ("model.embed_tokens.weight", &[5, 3]),
            ("model.layers.0.w", &[3, 3]),
            ("model.layers.0.b", &[3]),
            ("model.layers.1.w", &[3, 3]),
            ("model.layers.10.w", &[2]),
            ("model.norm.weight", &[3]),
        ]);
        let specs = vec![
            UnitSpec::new("embed", ["model.embed_tokens."]),
            UnitSpec::new("layer0", ["model.layers.0"]),
            UnitSpec::new("layer1", ["model.layers.1"]),
            UnitSpec::new("layer10", ["model.layers.10."]),
            UnitSpec::new("head", ["model.norm.", "lm_head"]),
        ];
        for world in 1..=4 {
            let layout = UnitLayout::new(&p, &specs, world).unwrap();
            let head = layout.find("head").unwrap();
            assert_eq!(
                layout.units()[head].params,
                vec![0, 6],
                "lm_head then model.norm, in name order"
            );
            assert_eq!(layout.units()[1].params, vec![2, 3], "layer0 not layer10");
            for (u, unit) in layout.units().iter().enumerate() {
                let mut expected_offset = 0;
                let mut owners = vec![0; layout.padded_len(u)];
                for &q in &unit.params {
                    assert_eq!(layout.unit_of(q), u);
                    assert_eq!(layout.offset(q), expected_offset);
                    let n = layout.shape(q).elem_count();
                    for rank in 0..world {
                        if let Some(piece) = layout.piece(q, rank) {
                            let block = rank * layout.block(u)..(rank + 1) * layout.block(u);
                            for e in piece {
                                let at = expected_offset + e;
                                assert!(block.contains(&at), "rank {rank} keeps its own block");
                                owners[at] += 1;
                            }
                        }
                    }
                    expected_offset += n;
                }
                assert!(owners[..expected_offset].iter().all(|&c| c == 1));
                assert!(owners[expected_offset..].iter().all(|&c| c == 0));
                assert_eq!(layout.padded_len(u) % world, 0);
                assert!(layout.padded_len(u) - expected_offset < world);
            }
        }
    }

    #[test]
    fn refuses_what_is_not_one_unit_per_parameter() {
        let p = params(&[("a.w", &[2]), ("b.w", &[2])]);
        let err = |specs: Vec<UnitSpec>| UnitLayout::new(&p, &specs, 2).unwrap_err().to_string();
        let e = err(vec![UnitSpec::new("a", ["a."])]);
        assert!(e.contains("belong to no unit") && e.contains("b.w"), "{e}");
        let e = err(vec![
            UnitSpec::new("a", ["a.", "b."]),
            UnitSpec::new("b", ["b"]),
        ]);
        assert!(e.contains("two units") && e.contains("b.w"), "{e}");
        let e = err(vec![
            UnitSpec::new("a", ["a."]),
            UnitSpec::new("b", ["b."]),
            UnitSpec::new("c", ["c."]),
        ]);
        assert!(e.contains("\"c\" holds no parameter"), "{e}");
        let e = err(vec![UnitSpec::new("a", ["a."]), UnitSpec::new("a", ["b."])]);
        assert!(e.contains("two units are named"), "{e}");
        assert!(err(vec![]).contains("declares no units"));
        let layout = UnitLayout::new(&p, &[UnitSpec::new("all", ["a.", "b."])], 3).unwrap();
        assert!(layout
            .find("none")
            .unwrap_err()
            .to_string()
            .contains("[\"all\"]"));
    }
}
