//! A fully sharded model's state: this rank's pieces of every parameter, the units' window
//! gradients, and the passes that gather, recompute and reduce unit by unit.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, TensorId, Var};

use super::layout::UnitLayout;
use super::node::{SeedGradient, UnitNode};
use super::params::{Block, Running, UnitParams};
use super::prefetch::{Pass, Prefetcher};
use crate::comm::{Communicator, ReduceOp};
use crate::cpu_slices::all_finite;
use crate::error::{Error, Result};
use crate::grads::GradientBuffers;
use crate::sync::{reduce_scatter_mean, GradientSyncStats};
use crate::zero::CommLink;

/// What a backward pass tells the units' backward passes (set by the training state's
/// `backward` for the length of `loss.backward()`).
#[derive(Debug)]
struct BackwardPass {
    /// The factor each micro-step's gradient is added with (the window's loss scale, the fp16
    /// scale divided out).
    scale: f64,
    /// Whether this micro-step syncs: each unit's window gradient is reduce-scattered as soon as
    /// its backward is done.
    sync: bool,
    /// The dtype gradients travel in.
    reduce_dtype: DType,
}

/// What changes within a window.
#[derive(Debug)]
struct Window {
    /// Per unit: the window's sum of its gradients, whole (allocated from the window's first
    /// backward through the unit until its reduce-scatter).
    grads: Vec<GradientBuffers>,
    /// Per unit, after the sync: this rank's block of the averaged gradient.
    synced: Vec<Option<Tensor>>,
    /// Per parameter (sorted index): whether this rank gave it a gradient in the synced window.
    present: Vec<bool>,
    /// Per unit: its forward passes whose backward has not run yet (counted since the last
    /// backward pass ended). A unit may run several times in one forward pass (Llama's packed
    /// rows run every unit once per group of documents); its window sum is reduce-scattered
    /// when its last backward of the sync micro-step is done.
    pending: Vec<usize>,
    /// Counts the backward passes ended; a unit's node dropped without its backward (an
    /// evaluation's forward) takes back its pending count only within the generation it was
    /// counted in.
    generation: u64,
    /// Per unit: its backward runs in this window, which every rank must agree on.
    runs: Vec<u64>,
    /// Per unit, when gathered units are kept for the window: its gathered buffer.
    gathered: Vec<Option<Tensor>>,
    pass: Option<BackwardPass>,
    /// Traffic not yet handed to the accelerator's counters.
    traffic: GradientSyncStats,
}

/// A model prepared under ZeRO stage 3 (see the `fsdp` module).
pub(crate) struct FsdpState {
    layout: UnitLayout,
    rank: usize,
    /// Every parameter's name and this rank's piece of it (1-D, possibly empty), sorted by name:
    /// what the optimizer updates.
    pieces: Vec<(String, Var)>,
    /// The dtype the units compute in, and their parameters are gathered in.
    compute_dtype: DType,
    device: Device,
    /// Per unit: the one-element variable that keeps the unit's node in the graph.
    anchors: Vec<Var>,
    /// The whole parameters the model was prepared from: none may receive a gradient (a model
    /// reading one outside its units would train on values no optimizer updates).
    whole_ids: Vec<(String, TensorId)>,
    link: CommLink,
    /// Whether a unit's gathered buffer is kept from its first gather in a window until the
    /// window's sync (or an optimizer step), instead of gathered for every pass.
    keep_gathered: bool,
    /// Gathers the units expected next on a thread of their own (none: each unit is gathered
    /// on the training thread when it runs).
    prefetch: Option<Prefetcher>,
    window: Mutex<Window>,
}

/// Locks `m`, ignoring poison: every update under these locks leaves consistent state.
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl std::fmt::Debug for FsdpState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FsdpState")
            .field("units", &self.layout.units().len())
            .field("rank", &self.rank)
            .field("compute_dtype", &self.compute_dtype)
            .finish_non_exhaustive()
    }
}

impl FsdpState {
    /// Shards `whole` (sorted by name; rank 0's values on every rank) by `layout`: this rank keeps
    /// its piece of each, in `master_dtype`; units are gathered and compute in `compute_dtype`
    /// (FSDP's `MixedPrecisionPolicy.param_dtype`), or the parameters' own dtype without one.
    /// `prefetch` gathers units ahead of their use.
    pub fn new(
        layout: UnitLayout,
        (rank, device): (usize, &Device),
        whole: &[(String, Var)],
        (master_dtype, compute_dtype): (DType, Option<DType>),
        link: CommLink,
        (keep_gathered, prefetch): (bool, Option<Prefetcher>),
    ) -> Result<Self> {
        let own_dtype = match whole.first() {
            Some((_, v)) => v.dtype(),
            None => {
                return Err(Error::Parameters(
                    "a sharded model without parameters".into(),
                ))
            }
        };
        if let Some((name, v)) = whole.iter().find(|(_, v)| v.dtype() != own_dtype) {
            return Err(Error::Parameters(format!(
                "parameter {name:?} is {:?} while the others are {own_dtype:?}; under ZeRO \
                 stage 3 a model's parameters share one dtype (each unit is gathered as one \
                 buffer)",
                v.dtype()
            )));
        }
        let compute_dtype = compute_dtype.unwrap_or(own_dtype);
        let mut pieces = Vec::with_capacity(whole.len());
        for (p, (name, var)) in whole.iter().enumerate() {
            let piece = match layout.piece(p, rank) {
                Some(range) => {
                    let flat = var.as_tensor().flatten_all()?;
                    let part = flat.narrow(0, range.start, range.len())?;
                    // Onto the device: the whole model may lie on the host (see `prepare`); a
                    // compact copy, as `to_device` of a view moves the whole storage behind it.
                    let part =
                        crate::comm::staging::compact_copy(&part.to_dtype(master_dtype)?, device)?;
                    Var::from_tensor(&part)?
                }
                // Empty, on the host: no zero-size allocation on a GPU; it never gets a gradient.
                None => Var::zeros(0, master_dtype, &Device::Cpu)?,
            };
            pieces.push((name.clone(), piece));
        }
        let units = layout.units().len();
        let grads = layout
            .units()
            .iter()
            .enumerate()
            .map(|(u, unit)| {
                let params: Vec<(String, candle_core::Shape)> = unit
                    .params
                    .iter()
                    .map(|&p| (whole[p].0.clone(), layout.shape(p).clone()))
                    .collect();
                GradientBuffers::for_unit(&params, master_dtype, device, layout.padded_len(u))
            })
            .collect::<Result<Vec<_>>>()?;
        let anchors = (0..units)
            .map(|_| Ok(Var::zeros(1, DType::F32, device)?))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            rank,
            pieces,
            compute_dtype,
            device: device.clone(),
            anchors,
            whole_ids: whole
                .iter()
                .map(|(n, v)| (n.clone(), v.as_tensor().id()))
                .collect(),
            link,
            keep_gathered,
            prefetch,
            window: Mutex::new(Window {
                grads,
                synced: vec![None; units],
                present: vec![false; whole.len()],
                pending: vec![0; units],
                generation: 0,
                runs: vec![0; units],
                gathered: vec![None; units],
                pass: None,
                traffic: GradientSyncStats::default(),
            }),
            layout,
        })
    }

    /// Every parameter's name and this rank's piece of it, sorted by name.
    pub fn pieces(&self) -> &[(String, Var)] {
        &self.pieces
    }

    /// The layout.
    pub fn layout(&self) -> &UnitLayout {
        &self.layout
    }

    /// Whether `var` is one of the whole parameters the model was prepared from.
    pub fn was_prepared_from(&self, var: &Var) -> bool {
        let id = var.as_tensor().id();
        self.whole_ids.iter().any(|(_, i)| *i == id)
    }

    /// This rank's block of unit `u`'s flat buffer, in `dtype`: its pieces in layout order, then
    /// zeros to the block's length. With prefetch, always a buffer of its own (a gather on
    /// another thread reads it).
    fn send_buffer(&self, u: usize, dtype: DType) -> Result<Tensor> {
        let block = self.layout.block(u);
        let mut parts = Vec::new();
        let mut filled = 0;
        for &p in &self.layout.units()[u].params {
            // Detached: the gathered buffer is outside the graph (alone, the "gather" is the
            // pieces themselves, which are variables).
            let piece = self.pieces[p].1.as_tensor().detach();
            if piece.elem_count() > 0 {
                filled += piece.elem_count();
                parts.push(piece.to_dtype(dtype)?);
            }
        }
        if filled < block {
            parts.push(Tensor::zeros(block - filled, dtype, &self.device)?);
        }
        Ok(match parts.as_slice() {
            // `cat` of one tensor (and a cast to its own dtype) shares the piece's storage,
            // which the prefetch thread must not read while the pieces may change.
            [one] if self.prefetch.is_some() => one.copy()?,
            _ => Tensor::cat(&parts, 0)?,
        })
    }

    /// Unit `u`'s flat buffer, all-gathered from every rank's pieces, in `dtype` (padded; the
    /// parameters at their layout offsets).
    fn gather(&self, comm: &dyn Communicator, u: usize, dtype: DType) -> Result<Tensor> {
        let send = self.send_buffer(u, dtype)?;
        let gathered = if comm.world_size() == 1 {
            send
        } else {
            let out = Tensor::zeros(self.layout.padded_len(u), dtype, &self.device)?;
            comm.all_gather_into_agreed(&send, &out)?;
            out
        };
        Ok(gathered)
    }

    /// [`gather`](Self::gather) for unit `u` about to run in `pass`, counted as gradient-sync
    /// traffic: from the prefetch thread when there is one (which gathers the units expected next
    /// meanwhile). With gathered units kept for the window, the kept buffer when there is one.
    fn gather_for_pass(&self, comm: &dyn Communicator, u: usize, pass: Pass) -> Result<Tensor> {
        let kept = |v: usize| lock(&self.window).gathered[v].is_some();
        let count = |units: &[usize]| {
            let mut window = lock(&self.window);
            for &v in units {
                window.traffic.all_gathers += 1;
                window.traffic.gathers_ahead += u64::from(v != u);
                window.traffic.gather_bytes +=
                    (self.layout.padded_len(v) * self.compute_dtype.size_in_bytes()) as u64;
            }
        };
        let gathered = match &self.prefetch {
            Some(prefetch) => {
                let send = |v: usize| self.send_buffer(v, self.compute_dtype);
                let (gathered, asked) = prefetch.take(u, pass, &kept, &send)?;
                count(&asked);
                gathered
            }
            None if kept(u) => None,
            None => {
                let gathered = self.gather(comm, u, self.compute_dtype)?;
                count(&[u]);
                Some(gathered)
            }
        };
        let mut window = lock(&self.window);
        let gathered = match gathered {
            Some(g) => g,
            None => {
                return Ok(window.gathered[u]
                    .clone()
                    .expect("a unit without a gathered buffer is kept"))
            }
        };
        if self.keep_gathered {
            window.gathered[u] = Some(gathered.clone());
        }
        Ok(gathered)
    }

    /// Drops the kept gathered units and those gathered ahead: the pieces are about to change
    /// (an optimizer step, a restore), or the window ended.
    pub fn release_gathered(&self) {
        if let Some(prefetch) = &self.prefetch {
            prefetch.release();
        }
        lock(&self.window)
            .gathered
            .iter_mut()
            .for_each(|g| *g = None);
    }

    /// Unit `u`'s parameters as views of its gathered buffer `flat`, by name.
    fn views(&self, u: usize, flat: &Tensor) -> Result<Vec<(String, Tensor)>> {
        self.layout.units()[u]
            .params
            .iter()
            .map(|&p| {
                let shape = self.layout.shape(p);
                let view = flat
                    .narrow(0, self.layout.offset(p), shape.elem_count())?
                    .reshape(shape)?;
                Ok((self.pieces[p].0.clone(), view))
            })
            .collect()
    }

    fn params(&self, tensors: HashMap<String, Tensor>) -> UnitParams {
        UnitParams::new(tensors, self.compute_dtype, self.device.clone())
    }

    /// Unit `u`'s forward: gathers its parameters, runs `block` outside the graph, frees them, and
    /// returns the output as the unit's node.
    pub fn forward_unit(self: Arc<Self>, u: usize, x: &Tensor, block: Block) -> Result<Tensor> {
        let name = self.layout.units()[u].name.clone();
        let y = {
            let _running = Running::enter(&name)?;
            let flat = self.link.with("a sharded unit's forward", |comm| {
                self.gather_for_pass(comm, u, Pass::Forward)
            })?;
            let params = self.params(self.views(u, &flat)?.into_iter().collect());
            block(&x.detach(), &params)?
        };
        if y.track_op() {
            return Err(Error::Parameters(format!(
                "unit {name:?} read a tensor that needs a gradient other than its input and its \
                 parameters (a parameter kept from before prepare, or another unit's output \
                 captured by its code); read parameters from the UnitParams it is given and \
                 pass the one tracked input as the unit's input"
            )));
        }
        let generation = {
            let mut window = lock(&self.window);
            window.pending[u] += 1;
            window.generation
        };
        let anchor = self.anchors[u].as_tensor().clone();
        let state = self.clone();
        let node = UnitNode {
            output: Mutex::new(Some(y)),
            backward: Arc::new(move |x, grad_y| self.backward_unit(u, x, grad_y, &block)),
            abandoned: Box::new(move || {
                let mut window = lock(&state.window);
                if window.generation == generation {
                    window.pending[u] = window.pending[u].saturating_sub(1);
                }
            }),
            backward_ran: std::sync::atomic::AtomicBool::new(false),
        };
        Ok(x.apply_op2(&anchor, node)?)
    }

    /// Unit `u`'s backward, inside the outer backward pass: gathers its parameters again,
    /// recomputes it on `x`, differentiates it with `grad_y` as the output's gradient, adds the
    /// parameters' gradients into the unit's window sum (reduce-scattering it when the
    /// micro-step syncs), and returns `x`'s gradient if `x` needs one.
    pub fn backward_unit(
        &self,
        u: usize,
        x: &Tensor,
        grad_y: &Tensor,
        block: &Block,
    ) -> Result<Option<Tensor>> {
        let name = &self.layout.units()[u].name;
        let (scale, sync, reduce_dtype) = {
            let mut window = lock(&self.window);
            let pass = window.pass.as_mut().ok_or_else(|| {
                Error::Config(format!(
                    "the backward pass reached sharded unit {name:?} outside \
                     accelerator.backward(loss); under ZeRO stage 3 gradients reach the \
                     parameters only through it"
                ))
            })?;
            let (scale, sync, reduce_dtype) = (pass.scale, pass.sync, pass.reduce_dtype);
            // A forward pass the count missed (none should) leaves the reduction to the end of
            // the backward pass, which reduces every unit not yet reduced.
            window.pending[u] = window.pending[u].saturating_sub(1);
            window.runs[u] += 1;
            (scale, sync && window.pending[u] == 0, reduce_dtype)
        };
        let flat = self.link.with("a sharded unit's backward", |comm| {
            self.gather_for_pass(comm, u, Pass::Backward)
        })?;
        // Fresh variables, copies: the gathered buffer is freed before the recomputation.
        let vars: Vec<(String, Var)> = self
            .views(u, &flat)?
            .into_iter()
            .map(|(n, t)| Ok((n, Var::from_tensor(&t)?)))
            .collect::<Result<_>>()?;
        drop(flat);
        let wants_x = x.track_op();
        let input = if wants_x {
            Var::from_tensor(&x.detach())?.as_tensor().clone()
        } else {
            x.detach()
        };
        let grads = {
            let _running = Running::enter(name)?;
            let params = self.params(
                vars.iter()
                    .map(|(n, v)| (n.clone(), v.as_tensor().clone()))
                    .collect(),
            );
            let y = block(&input, &params)?;
            y.apply_op1(SeedGradient {
                gradient: grad_y.clone(),
            })?
            .backward()?
        };
        {
            let mut window = lock(&self.window);
            let buffers = &mut window.grads[u];
            for (n, v) in &vars {
                if let Some(g) = grads.get(v.as_tensor()) {
                    buffers.accumulate_one(n, g, scale)?;
                }
            }
        }
        let grad_x = if wants_x {
            Some(match grads.get(&input) {
                Some(g) => g.clone(),
                None => x.zeros_like()?,
            })
        } else {
            None
        };
        drop(grads);
        drop(vars);
        if sync {
            self.link
                .with("a sharded unit's gradient reduction", |comm| {
                    self.reduce_unit(comm, u, reduce_dtype)
                })?;
        }
        Ok(grad_x)
    }

    /// Reduce-scatters unit `u`'s window gradient (mean) into this rank's block and releases the
    /// whole one; records which parameters this rank gave a gradient.
    fn reduce_unit(&self, comm: &dyn Communicator, u: usize, reduce_dtype: DType) -> Result<()> {
        let mut window = lock(&self.window);
        let window = &mut *window;
        let buffers = &mut window.grads[u];
        for &p in &self.layout.units()[u].params {
            window.present[p] = buffers.get(&self.pieces[p].0).is_some();
        }
        let flat = buffers.allocate_unit()?.clone();
        let block = Tensor::zeros(self.layout.block(u), flat.dtype(), flat.device())?;
        window.traffic += reduce_scatter_mean(comm, &flat, &block, reduce_dtype)?;
        drop(flat);
        buffers.release_all()?;
        window.synced[u] = Some(block);
        Ok(())
    }

    /// Begins a backward pass (see [`BackwardPass`]); an error if one is already under way.
    pub fn begin_backward(&self, scale: f64, sync: bool, reduce_dtype: DType) -> Result<()> {
        let mut window = lock(&self.window);
        if window.pass.is_some() {
            return Err(Error::Config(
                "a backward pass began inside another one".into(),
            ));
        }
        window.pass = Some(BackwardPass {
            scale,
            sync,
            reduce_dtype,
        });
        Ok(())
    }

    /// Ends the backward pass, whatever its outcome.
    pub fn end_backward(&self) {
        let mut window = lock(&self.window);
        window.pass = None;
        window.pending.fill(0);
        window.generation += 1;
    }

    /// Refuses a gradient that reached one of the whole parameters the model was prepared from:
    /// the model read it outside its units, and its gradient would be lost.
    pub fn check_outer_gradients(&self, grads: &GradStore) -> Result<()> {
        match self
            .whole_ids
            .iter()
            .find(|(_, id)| grads.get_id(*id).is_some())
        {
            Some((name, _)) => Err(Error::Parameters(format!(
                "parameter {name:?} was read outside the model's units (its gradient reached \
                 the whole parameter the model was prepared from); under ZeRO stage 3 every \
                 parameter is read through its unit's ShardedUnit::forward"
            ))),
            None => Ok(()),
        }
    }

    /// The end of a sync micro-step's backward: every unit not yet reduced (one that did not run
    /// in this pass) is reduced now, in unit order, so every rank makes the same calls; then one
    /// all-reduce agrees on which parameters got a gradient on some rank and whether some
    /// rank's gradient is not finite, and this rank's pieces of the averaged gradients are
    /// written into `pieces_grads` (built over [`pieces`](Self::pieces)). Returns whether some
    /// rank's gradient was not finite.
    pub fn finish_sync(
        &self,
        comm: &dyn Communicator,
        reduce_dtype: DType,
        check_finite: bool,
        pieces_grads: &mut GradientBuffers,
    ) -> Result<bool> {
        self.agree_on_runs(comm)?;
        for u in 0..self.layout.units().len() {
            if lock(&self.window).synced[u].is_none() {
                self.reduce_unit(comm, u, reduce_dtype)?;
            }
        }
        let mut window = lock(&self.window);
        let window = &mut *window;
        let mut nonfinite_here = false;
        for block in window.synced.iter().flatten().filter(|_| check_finite) {
            nonfinite_here |= !all_finite(block)?;
        }
        let mut flags: Vec<f32> = window
            .present
            .iter()
            .map(|&p| f32::from(u8::from(p)))
            .collect();
        flags.push(f32::from(u8::from(nonfinite_here)));
        let flags = Tensor::new(flags.as_slice(), &Device::Cpu)?;
        if comm.world_size() > 1 {
            comm.all_reduce_agreed(&flags, ReduceOp::Max)?;
            window.traffic.all_reduces += 1;
            window.traffic.bytes += (flags.elem_count() * 4) as u64;
        }
        let flags = flags.to_vec1::<f32>()?;
        for (p, (name, _)) in self.pieces.iter().enumerate() {
            let (Some(piece), true) = (self.layout.piece(p, self.rank), flags[p] > 0.0) else {
                continue;
            };
            let u = self.layout.unit_of(p);
            let block = window.synced[u]
                .as_ref()
                .expect("every unit was reduced above");
            let start = self.layout.offset(p) + piece.start - self.rank * self.layout.block(u);
            let grad = block.narrow(0, start, piece.len())?;
            pieces_grads.accumulate_one(name, &grad, 1.0)?;
        }
        window.synced.iter_mut().for_each(|s| *s = None);
        window.present.fill(false);
        window.runs.fill(0);
        window.gathered.iter_mut().for_each(|g| *g = None);
        Ok(flags[self.pieces.len()] > 0.0)
    }

    /// Refuses a window in which the ranks ran some unit's backward a different number of
    /// times: their gathers and reductions were paired wrongly (equal sizes pair silently), so
    /// its gradients are not the average they should be. One small all-reduce (max) of each
    /// unit's run count and its negation, before any further reduction.
    fn agree_on_runs(&self, comm: &dyn Communicator) -> Result<()> {
        if comm.world_size() == 1 {
            return Ok(());
        }
        // With prefetch, the gathers the prefetch thread was asked for so far too (modulo 2^20,
        // exact in f32).
        let issued = self
            .prefetch
            .as_ref()
            .map(|p| (p.issued() % (1 << 20)) as f32);
        let runs: Vec<f32> = {
            let window = lock(&self.window);
            let counts = window.runs.iter().map(|&r| r as f32).chain(issued);
            counts.clone().chain(counts.map(|r| -r)).collect()
        };
        let runs = Tensor::new(runs.as_slice(), &Device::Cpu)?;
        comm.all_reduce_agreed(&runs, ReduceOp::Max)?;
        {
            let mut window = lock(&self.window);
            window.traffic.all_reduces += 1;
            window.traffic.bytes += (runs.elem_count() * 4) as u64;
        }
        let runs = runs.to_vec1::<f32>()?;
        let units = self.layout.units();
        let (most, fewest) = runs.split_at(runs.len() / 2);
        if issued.is_some() && most[units.len()] != -fewest[units.len()] {
            return Err(Error::Config(
                "the ranks' prefetch threads were asked for different numbers of gathers (a \
                 rank dropped the units it had gathered ahead after an error of its own), so \
                 their gathers no longer pair up; restart the job from its last checkpoint"
                    .into(),
            ));
        }
        match (0..units.len()).find(|&u| most[u] != -fewest[u]) {
            None => Ok(()),
            Some(u) => Err(Error::Config(format!(
                "unit {:?} ran its backward pass between {} and {} times in this window on \
                 different ranks, so their gathers and reductions were paired wrongly; under \
                 ZeRO stage 3 every rank runs the same units the same number of times per \
                 micro-step (a data-dependent number of passes, or a rank that skips a batch, \
                 breaks this)",
                units[u].name, -fewest[u], most[u]
            ))),
        }
    }

    /// Forgets the window's gradients (an abandoned window, or a restored state), and the
    /// units gathered for it.
    pub fn discard_window(&self) -> Result<()> {
        self.release_gathered();
        let mut window = lock(&self.window);
        for buffers in &mut window.grads {
            buffers.release_all()?;
        }
        window.synced.iter_mut().for_each(|s| *s = None);
        window.present.fill(false);
        window.runs.fill(0);
        Ok(())
    }

    /// A copy of the window's gradient sums so far, whole, by parameter name (the parameters that
    /// got none yet are absent): what a checkpoint saved inside a window keeps of this rank, as
    /// stage 0 keeps its own window sums.
    pub fn window_gradients(&self) -> Result<BTreeMap<String, Tensor>> {
        let window = lock(&self.window);
        let mut saved = BTreeMap::new();
        for buffers in &window.grads {
            for name in buffers.names() {
                if let Some(t) = buffers.get(name) {
                    saved.insert(name.to_string(), t.copy()?);
                }
            }
        }
        Ok(saved)
    }

    /// Replaces the window's gradient sums with `saved` (whole gradients by parameter name, as
    /// [`window_gradients`](Self::window_gradients) gives them), each added into its unit's
    /// buffer; the parameters `saved` does not name have none. Nothing is kept of the window
    /// before, nor of a half-done restore when a name or a shape does not fit (the error names
    /// it).
    pub fn restore_window(&self, saved: &BTreeMap<String, Tensor>) -> Result<()> {
        self.discard_window()?;
        let restored = (|| -> Result<()> {
            let mut window = lock(&self.window);
            for (name, t) in saved {
                let p = self
                    .pieces
                    .binary_search_by(|(n, _)| n.as_str().cmp(name))
                    .map_err(|_| {
                        Error::Parameters(format!(
                            "a saved window gradient names no parameter of the model: {name:?}"
                        ))
                    })?;
                let u = self.layout.unit_of(p);
                window.grads[u].accumulate_one(name, &t.to_device(&self.device)?, 1.0)?;
            }
            Ok(())
        })();
        if restored.is_err() {
            self.discard_window()?;
        }
        restored
    }

    /// The traffic since the last call.
    pub fn take_traffic(&self) -> GradientSyncStats {
        std::mem::take(&mut lock(&self.window).traffic)
    }

    /// Every parameter whole, by name (sorted), on the host, in the pieces' dtype: gathered unit
    /// by unit, so that no rank's device holds more than one unit at a time. A collective; only
    /// a rank that `keeps` them holds them on its host (the others return nothing).
    pub fn whole_parameters(
        &self,
        comm: &dyn Communicator,
        keep: bool,
    ) -> Result<Vec<(String, Tensor)>> {
        let dtype = self.pieces.first().map_or(DType::F32, |(_, v)| v.dtype());
        let mut all = Vec::with_capacity(self.pieces.len());
        for u in 0..self.layout.units().len() {
            let flat = self.gather(comm, u, dtype)?;
            if !keep {
                continue;
            }
            let flat = flat.to_device(&Device::Cpu)?;
            for (name, view) in self.views(u, &flat)? {
                all.push((name, view.copy()?));
            }
        }
        all.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(all)
    }
}
