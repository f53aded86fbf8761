package replica

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"slices"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/api"
	"github.com/kvrouter/kvrouter/api/prompt"
	"github.com/kvrouter/kvrouter/cluster"
	"github.com/kvrouter/kvrouter/cmd/kvrouter/internal/k8spool"
	"github.com/kvrouter/kvrouter/eventbus"
	"github.com/kvrouter/kvrouter/fsm"
	"github.com/kvrouter/kvrouter/router"
)

// replica composes one kvrouter replica: the Raft node over the FSM, the
// event bus, one router per model reading the replicated index, and replica
// sync of load. It implements api.Replica with the optional api.DisaggReplica
// and api.Drainer, and eventbus.LoadSink; assemble builds it, start runs it.
type replica struct {
	cfg  Config
	log  *slog.Logger
	reg  *prometheus.Registry
	fsm  *fsm.FSM
	node *cluster.Node
	bus  *eventbus.Bus
	sync *eventbus.Syncer
	// tenants is the tenant-fairness ledger the API charges and replica
	// sync shares (nil: fairness off).
	tenants *api.TenantLedger
	// ctl is the control group (fsm, node) as a dataGroup; groups are the
	// data groups of a sharded index, none unsharded (groups.go).
	ctl    *dataGroup
	groups []*dataGroup
	// pool watches --inference-pool (nil: none; pool.go).
	pool *k8spool.Watcher

	// mu guards the three maps below (not the routers themselves, which
	// lock on their own): Router and Disagg create entries on first use
	// under the write lock, refresh re-reads every router under it, the
	// load paths read under the read lock.
	mu      sync.RWMutex
	routers map[string]*router.Router
	disagg  map[string]*router.DisaggRouter // --disagg always/auto: per model, beside routers
	models  map[router.WorkerID]string      // worker rank → model, for remote load

	health   *workerHealth
	preds    *predictionBatcher
	audit    *cacheAudit
	draining atomic.Bool     // SIGTERM received: not ready, finishing requests
	prompts  *prompt.Set     // which files tokenize each model (fingerprints in /cluster/status)
	tokcheck *tokenizerCheck // compares our prompt ids with each worker's /tokenize
	loras    *loraDirectory
	agree    *tokenizerAgreement // do the peers' model files match ours?
	state    *stateAgreement     // do the peers' replicated states match ours?
	capacity *capacityWatch      // logs refusals beyond a worker's index block cap
	gaps     *capacityGaps       // capacity-relative settings a worker's missing capacity disables

	sessWrites bgWrites[string]      // background session refreshes and ends (sessions.go)
	pinWrites  bgWrites[pinWriteKey] // background pin writes (pins.go)
	drained    drainHooks            // the API's listeners for committed drains (workerdrain.go)
}

// Adapter resolves a LoRA adapter to its base model and serving workers.
func (r *replica) Adapter(name string) (string, []router.WorkerID, bool) {
	if r.loras == nil || r.knownModel(name) {
		return "", nil, false
	}
	return r.loras.Adapter(name)
}

func (r *replica) Audit(w router.WorkerID, predicted, reported, _ int) {
	r.audit.observe(w, predicted, reported)
}

// Errors the replica maps onto the API's.
func apiError(err error) error {
	var rej *cluster.RejectedError
	switch {
	case err == nil:
		return nil
	case errors.Is(err, router.ErrInvalidConfig), errors.Is(err, fsm.ErrInvalidCommand), errors.As(err, &rej):
		return fmt.Errorf("%w: %v", api.ErrInvalid, err)
	case errors.Is(err, cluster.ErrNoLeader), errors.Is(err, cluster.ErrOutcomeUnknown):
		return fmt.Errorf("%w: %v", api.ErrUnavailable, err)
	}
	return err
}

func (r *replica) NodeID() string { return r.cfg.NodeID }

// Models are the configured models plus those of registered workers.
func (r *replica) Models() []string {
	set := map[string]bool{}
	for _, m := range r.cfg.Models {
		set[m] = true
	}
	for _, m := range r.fsmModels() {
		set[m] = true
	}
	out := make([]string, 0, len(set))
	for m := range set {
		out = append(out, m)
	}
	sort.Strings(out)
	return out
}

func (r *replica) knownModel(model string) bool { return slices.Contains(r.Models(), model) }

// Router returns the model's router, creating it on first use.
func (r *replica) Router(model string) (*router.Router, bool) {
	r.mu.RLock()
	rt, ok := r.routers[model]
	r.mu.RUnlock()
	if ok {
		return rt, true
	}
	if !r.knownModel(model) {
		return nil, false
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if rt, ok := r.routers[model]; ok {
		return rt, true
	}
	rt, err := router.New(r.modelConfig(model), r.overlaps(), uint64(time.Now().UnixNano()))
	if err != nil {
		r.log.Error("router for model", "model", model, "err", err)
		return nil, false
	}
	rt.UseSharedPredictions(r.predictedOverlaps(), r.preds.record)
	if r.cfg.Pins {
		rt.SetPinnedBlocks(r.pinnedBlocksOf(model)) // kv-pooled: pinned blocks are not evictable (pins.go)
	}
	rt.SetWorkers(decodeCapable(r.undrained(r.roleWorkers(model))))
	for _, w := range r.workerInfos(model) {
		r.models[w.ID] = model
	}
	r.routers[model] = rt
	return rt, true
}

// modelConfig is the replicated configuration of a model over our flags.
func (r *replica) modelConfig(model string) router.Config {
	c := r.fsm.ModelConfig(model)
	if r.sharded() {
		// The control group holds no workers: a model's block size is
		// its workers', in the data groups.
		if bs := r.modelBlockSize(model); bs > 0 {
			c.BlockSize = bs
		}
	}
	c.Mode = r.cfg.Router.Mode
	return c
}

// refresh re-reads workers and configuration into the routers after a
// replicated change.
func (r *replica) refresh() {
	r.mu.Lock()
	defer r.mu.Unlock()
	for model, rt := range r.routers {
		if rt.Config().BlockSize != r.modelConfig(model).BlockSize {
			// The model's block size changed (all its workers left, one of
			// another size registered): its hashes change with it, so the
			// router is rebuilt on next use (Router) rather than
			// reconfigured. Bookings on the old one end with their requests.
			r.log.Info("model block size changed: router rebuilt", "model", model,
				"from", rt.Config().BlockSize, "to", r.modelConfig(model).BlockSize)
			delete(r.routers, model)
			delete(r.disagg, model)
			continue
		}
		roles := r.roleWorkers(model)
		rt.SetWorkers(decodeCapable(r.undrained(roles)))
		for _, w := range roles {
			r.models[w.ID] = model
		}
		if err := rt.SetConfig(r.modelConfig(model)); err != nil {
			r.log.Error("replicated configuration rejected by the router", "model", model, "err", err)
		}
	}
	for model, d := range r.disagg {
		d.SetWorkers(r.undrained(r.roleWorkers(model)))
		if err := d.SetBaseConfig(r.modelConfig(model)); err != nil {
			r.log.Error("replicated configuration rejected by the disaggregated router", "model", model, "err", err)
		}
	}
}

// DPRank is the data-parallel rank id names when its worker runs several
// (sent to the engine so its own balancer keeps the rank we booked).
func (r *replica) DPRank(id router.WorkerID) (int, bool) {
	base, rank, _ := strings.Cut(string(id), "#")
	w, ok := r.worker(base)
	if !ok || w.DPRanks <= 1 {
		return 0, false
	}
	n := 0
	if rank != "" {
		if _, err := fmt.Sscan(rank, &n); err != nil {
			return 0, false
		}
	}
	return n, true
}

func (r *replica) WorkerURL(id router.WorkerID) (string, bool) {
	base, _, _ := strings.Cut(string(id), "#")
	w, ok := r.worker(base)
	if !ok || w.Address == "" {
		return "", false
	}
	return strings.TrimRight(w.Address, "/"), true
}

func (r *replica) ReadBarrier(ctx context.Context) error {
	if err := r.node.LinearizableRead(ctx); err != nil {
		return fmt.Errorf("%w: %v", api.ErrUnavailable, err)
	}
	return nil
}

func (r *replica) Thresholds(model string) (router.Thresholds, bool) {
	if !r.knownModel(model) {
		return router.Thresholds{}, false
	}
	return r.fsm.ModelConfig(model).Thresholds, true
}

func (r *replica) SetThresholds(ctx context.Context, model string, u api.ThresholdUpdate) (router.Thresholds, error) {
	cmd := fsm.SetModelConfig{Model: model, Thresholds: router.Thresholds{
		ActiveDecodeBlocks: u.ActiveDecodeBlocks, ActivePrefillTokens: u.ActivePrefillTokens, ActivePrefillTokensFrac: u.ActivePrefillTokensFrac}}
	if u.ClearActiveDecodeBlocks {
		cmd.Reset |= fsm.FieldActiveDecodeBlocks
	}
	if u.ClearActivePrefillTokens {
		cmd.Reset |= fsm.FieldActivePrefillTokens
	}
	if u.ClearActivePrefillTokensFrac {
		cmd.Reset |= fsm.FieldActivePrefillTokensFrac
	}
	// Validate before proposing: nothing invalid enters the log.
	if _, err := r.fsm.CheckModelConfig(cmd); err != nil {
		return router.Thresholds{}, fmt.Errorf("%w: %v", api.ErrInvalid, err)
	}
	b, err := fsm.EncodeSetModelConfig(cmd)
	if err != nil {
		return router.Thresholds{}, fmt.Errorf("%w: %v", api.ErrInvalid, err)
	}
	if err := r.propose(ctx, b); err != nil {
		return router.Thresholds{}, apiError(err)
	}
	// The change is committed; a follower's FSM may apply it a moment later.
	r.waitApplied(ctx)
	return r.fsm.ModelConfig(model).Thresholds, nil
}

// propose applies a command through Raft (forwarded when not the leader)
// and surfaces the FSM's domain error.
func (r *replica) propose(ctx context.Context, cmd []byte) error {
	return r.proposeOn(ctx, r.control(), cmd)
}

// proposeOn is propose in group g.
func (r *replica) proposeOn(ctx context.Context, g *dataGroup, cmd []byte) error {
	ctx, cancel := context.WithTimeout(ctx, proposeTimeout)
	defer cancel()
	resp, err := g.node.Apply(ctx, cmd)
	if err != nil {
		return err
	}
	if res, ok := resp.(*fsm.ApplyResult); ok && res.Err != nil {
		return res.Err
	}
	return nil
}

// waitApplied waits until this replica applied every write committed so far
// (read-your-writes on followers: the answer reflects the write it follows),
// bounded by ctx and readYourWritesWait.
func (r *replica) waitApplied(ctx context.Context) { r.waitAppliedOn(ctx, r.control()) }

// waitAppliedOn is waitApplied in group g.
func (r *replica) waitAppliedOn(ctx context.Context, g *dataGroup) {
	ctx, cancel := context.WithTimeout(ctx, readYourWritesWait)
	defer cancel()
	if err := g.node.LinearizableRead(ctx); err != nil {
		r.log.Debug("read-your-writes barrier", "err", err)
	}
}

func (r *replica) RegisterWorker(ctx context.Context, w api.WorkerSpec) error {
	ranks := uint32(max(w.DPRanks, 1))
	cmd := fsm.RegisterWorker{ID: w.ID, DPRanks: ranks, Address: w.URL, Model: w.Model, BlockSize: w.BlockSize,
		TotalBlocks: w.TotalBlocks, MaxBatchedTokens: w.MaxBatchedTokens, LeaseUntil: time.Now().Add(leaseFor).UnixNano(),
		Role: router.Role(w.Role)}
	if err := cmd.Validate(); err != nil {
		return fmt.Errorf("%w: %v", api.ErrInvalid, err)
	}
	// Each model has its own block size (fixed by its first worker while
	// any is registered); the check also marks a registration whose size
	// differs from the cluster default, which travels as its own command
	// type so a build that predates per-model sizes halts instead of
	// diverging (fsm/DESIGN.md).
	g, err := r.placeWorker(ctx, w.ID)
	if err != nil {
		return apiError(err)
	}
	if err := r.checkFleetBlockSize(cmd, g); err != nil {
		return fmt.Errorf("%w: %v", api.ErrInvalid, err)
	}
	cmd, err = g.fsm.CheckRegisterWorker(cmd)
	if err != nil {
		return fmt.Errorf("%w: %v", api.ErrInvalid, err)
	}
	b, err := fsm.EncodeRegisterWorker(cmd)
	if err != nil {
		return fmt.Errorf("%w: %v", api.ErrInvalid, err)
	}
	if err := r.proposeOn(ctx, g, b); err != nil {
		return apiError(err)
	}
	r.waitAppliedOn(ctx, g)
	return nil
}

func (r *replica) DeregisterWorker(ctx context.Context, id string) error {
	g, placed := r.groupOf(id)
	if _, ok := r.worker(id); !ok || !placed {
		return fmt.Errorf("%w: worker %q is not registered", api.ErrInvalid, id)
	}
	b, err := fsm.EncodeDeregisterWorker(fsm.DeregisterWorker{ID: id})
	if err != nil {
		return fmt.Errorf("%w: %v", api.ErrInvalid, err)
	}
	return apiError(r.proposeOn(ctx, g, b))
}

// Draining reports SIGTERM received (api.Drainer).
func (r *replica) Draining() bool { return r.draining.Load() }

func (r *replica) Ready() (bool, string) {
	if r.draining.Load() {
		return false, "draining: shutting down"
	}
	ok, reason := r.node.Ready()
	if !ok {
		return false, reason
	}
	// Groups beyond the cluster's count hold no worker yet (a replica
	// restarted with more, before the count grows: grow.go), so they do
	// not hold readiness back: their quorum forms as the others restart.
	for _, g := range r.activeGroups() {
		if ok, reason := g.node.Ready(); !ok {
			return false, fmt.Sprintf("raft group %d: %s", g.id, reason)
		}
	}
	if behind := r.groupsBehind(); behind != "" {
		return false, behind
	}
	if r.bus != nil && !r.bus.Conn().IsConnected() {
		return false, "event bus disconnected"
	}
	if len(r.workers()) == 0 && len(r.cfg.StaticWorkers) == 0 {
		return false, "no workers registered: nothing to route to"
	}
	if n := len(r.workers()); n < r.cfg.MinInitialWorkers {
		return false, fmt.Sprintf("%d of --router-min-initial-workers %d workers registered", n, r.cfg.MinInitialWorkers)
	}
	return true, "ok"
}

// Status is /cluster/status: the node's Raft status plus what routes.
func (r *replica) Status(digest bool) map[string]any {
	st := r.node.StatusWithoutDigest() // the digest below, only when asked
	out := map[string]any{
		"node_id": st.NodeID, "raft_addr": st.RaftAddr, "state": st.State, "leader_id": st.LeaderID,
		"leader_addr": st.LeaderAddr, "term": st.Term, "applied_index": st.AppliedIndex,
		"commit_index": st.CommitIndex, "last_snapshot_index": st.LastSnapshotIndex,
		"snapshots_restored": st.SnapshotsRestored, "peers": st.Peers, "ready": st.Ready,
		"ready_reason": st.ReadyReason, "pid": os.Getpid(),
		"index_blocks": r.indexBlocks(), "models": r.Models(), "http": r.cfg.AdvertiseHTTP,
	}
	if digest {
		out["digest"] = r.fsm.Digest()
	}
	if st.Halted != "" {
		// The state machine met a command type this build does not know:
		// the replica is not ready until upgraded (fsm/DESIGN.md).
		out["halted"] = st.Halted
	}
	nodes := []map[string]any{}
	for _, n := range r.fsm.Nodes() {
		nodes = append(nodes, map[string]any{"id": n.ID, "raft_addr": n.RaftAddr, "http_addr": n.HTTPAddr})
	}
	out["nodes"] = nodes
	workers := []map[string]any{}
	stale, cursors, refused := r.staleRanks(), r.cursors(), r.overCapacityRefused()
	bindings, pins := r.fsm.SessionsPerWorker(), r.fsm.PinsPerWorker()
	missing, drained := r.health.missing(), r.drainedSet()
	for _, w := range r.workers() {
		entry := map[string]any{"id": w.ID, "url": w.Address, "model": w.Model, "block_size": w.BlockSize,
			"total_kv_blocks": w.TotalBlocks, "max_num_batched_tokens": w.MaxBatchedTokens, "dp_ranks": w.DPRanks, "role": roleName(w.Role),
			// What the worker did not register, and which settings do not
			// apply to it for that (router/DESIGN.md, Workers without capacity).
			"capacity_missing": nonNil(router.MissingCapacity(workerInfo(w))),
			"capacity_gaps":    nonNil(workerGaps(r.modelConfig(w.Model), w)),
			// Per rank; blocks refused beyond it since this replica started (fsm/DESIGN.md, Bounds).
			"index_block_cap": fsm.RankBlockCap(w.TotalBlocks), "over_capacity_refused": refused[w.ID],
			"session_bindings": bindings[w.ID], "pins": pins[w.ID]}
		if g, ok := r.groupOf(w.ID); ok && r.sharded() {
			entry["raft_group"] = g.id
		}
		drainFields(drained, w.ID, entry) // workerdrain.go
		var ranks []map[string]any
		for _, key := range w.Keys() {
			rk := fsm.RankKey{Worker: w.ID, DPRank: rankOf(key)}
			rank := map[string]any{"rank": rk.DPRank, "blocks": r.heldBlocks(w.ID, key), "last_event_id": cursors[rk]}
			if s, ok := stale[rk]; ok {
				rank["stale"] = s.Reason
			}
			if since, ok := missing[key]; ok {
				rank["events_missing_for_s"] = since.Seconds()
			}
			ranks = append(ranks, rank)
		}
		entry["ranks"] = ranks
		r.tokcheck.statusFields(w.ID, entry)
		workers = append(workers, entry)
	}
	out["workers"] = workers
	out["sessions"] = r.sessionStatus()
	out["pins"] = r.pinStatus()
	if r.bus != nil {
		out["nats_url"] = r.bus.ClientURL()
	}
	if r.sync != nil {
		out["replica_sync"] = r.sync.Stats()
	}
	out["fsm"] = r.fsm.Stats()
	if r.sharded() {
		out["raft_groups"] = r.groupStatus(digest)
	}
	out["cache_audit"] = r.audit.report()
	if r.prompts != nil {
		out["tokenizers"] = r.prompts.Describe(r.Models())
	}
	if r.loras != nil {
		out["lora_adapters"] = r.loras.snapshot()
	}
	if r.agree != nil {
		out["tokenizer_agreement"] = r.agree.snapshot()
	}
	if r.tenants != nil {
		out["tenants"] = r.tenants.Status() // tenant fairness: the most charged tenants, fleet-wide
	}
	out["digest_checkpoints"] = r.fsm.Checkpoints()
	if r.state != nil {
		out["state_agreement"] = r.state.snapshot()
	}
	return out
}

func roleName(r router.Role) router.Role {
	if r == "" {
		return router.RoleBoth
	}
	return r
}

func rankOf(id router.WorkerID) uint32 {
	_, rank, ok := strings.Cut(string(id), "#")
	if !ok {
		return 0
	}
	var n uint32
	fmt.Sscan(rank, &n)
	return n
}

// Load notifications: publish to the other replicas.

func (r *replica) Booked(model string, b router.Booking) {
	r.health.noteRouted(b.Worker)
	if r.sync == nil {
		return
	}
	overlap := 0
	if bs := r.modelBlockSize(model); bs > 0 {
		overlap = len(b.Hashes) - (b.PrefillTokens+bs-1)/bs
	}
	if err := r.sync.Add(eventbus.ActiveRequest{Request: b.ID, Worker: b.Worker, Hashes: b.Hashes,
		ISL: b.PrefillTokens, Overlap: max(overlap, 0), Sequences: b.Sequences}); err != nil {
		r.log.Debug("replica sync add", "err", err)
	}
}

func (r *replica) PrefillDone(_, id string) {
	if r.sync != nil {
		_ = r.sync.PrefillDone(id)
	}
}

// Output announces a request's output progress (output-block tracking):
// the API calls it once per new output block, not per token.
func (r *replica) Output(_, id string, o router.OutputProgress) {
	if r.sync != nil {
		_ = r.sync.Output(id, o)
	}
}

func (r *replica) Freed(_, id string) {
	if r.sync != nil {
		_ = r.sync.Free(id)
	}
}

// Remote load (eventbus.LoadSink): other replicas' requests booked into our
// routers under their replica id, so a silent replica's load can be dropped.

func (r *replica) routerOfWorker(w router.WorkerID) (*router.Router, string) {
	r.mu.RLock()
	model, ok := r.models[w]
	r.mu.RUnlock()
	if !ok {
		// A worker this replica has not routed to yet: learn its model.
		base, _, _ := strings.Cut(string(w), "#")
		rec, found := r.worker(base)
		if !found {
			return nil, ""
		}
		model = rec.Model
	}
	rt, _ := r.Router(model)
	return rt, model
}

func remoteID(replica, req string) string { return replica + "/" + req }

func (r *replica) AddRemote(replica string, req eventbus.ActiveRequest) {
	rt, model := r.routerOfWorker(req.Worker)
	if rt == nil {
		return
	}
	r.stageLoad(model, req.Request, rt).Add(router.Booking{ID: remoteID(replica, req.Request), Origin: replica, Worker: req.Worker,
		Hashes: req.Hashes, PrefillTokens: req.ISL, PrefillDone: req.PrefillDone, Sequences: req.Sequences, Added: time.Now(),
		Output: req.Progress()})
}

func (r *replica) OutputRemote(replica, request string, out router.OutputProgress) {
	r.eachRouter(func(rt *router.Router) { rt.Load().SetOutput(remoteID(replica, request), out) })
}

func (r *replica) PrefillDoneRemote(replica, request string) {
	r.eachRouter(func(rt *router.Router) { rt.Load().PrefillDone(remoteID(replica, request)) })
}

func (r *replica) FreeRemote(replica, request string) {
	r.eachRouter(func(rt *router.Router) { rt.Load().Free(remoteID(replica, request)) })
}

func (r *replica) ReplaceReplica(replica string, active []eventbus.ActiveRequest) {
	r.dropLoad(replica)
	for _, a := range active {
		r.AddRemote(replica, a)
	}
}

// DropReplica forgets a silent replica: its load and its tenants' usage.
func (r *replica) DropReplica(replica string) {
	r.dropLoad(replica)
	if r.tenants != nil {
		r.tenants.DropRemote(replica)
	}
}

func (r *replica) dropLoad(replica string) {
	r.eachRouter(func(rt *router.Router) { rt.Load().DropOrigin(replica) })
}

// TenantsRemote takes another replica's tenant usage (eventbus.TenantSink).
func (r *replica) TenantsRemote(replica string, usage []eventbus.TenantUsage) {
	if r.tenants == nil {
		return
	}
	u := make([]api.TenantUsage, len(usage))
	for i, x := range usage {
		u[i] = api.TenantUsage(x)
	}
	r.tenants.Remote(replica, u)
}

// tenantUsage is this replica's tenant usage for replica sync.
func (r *replica) tenantUsage() []eventbus.TenantUsage {
	local := r.tenants.Usage()
	u := make([]eventbus.TenantUsage, len(local))
	for i, x := range local {
		u[i] = eventbus.TenantUsage(x)
	}
	return u
}

func (r *replica) eachRouter(fn func(*router.Router)) {
	r.mu.RLock()
	rts := make([]*router.Router, 0, len(r.routers))
	for _, rt := range r.routers {
		rts = append(rts, rt)
	}
	for _, d := range r.disagg {
		pr, dc := d.Routers()
		rts = append(rts, pr, dc)
	}
	r.mu.RUnlock()
	for _, rt := range rts {
		fn(rt)
	}
}

// The interfaces the replica implements: api.Replica, and the optional ones
// the API finds by type assertion (documented beside api.Replica), and the
// replica-sync sink of the other replicas' load.
var (
	_ api.Replica         = (*replica)(nil)
	_ api.DisaggReplica   = (*replica)(nil)
	_ api.Drainer         = (*replica)(nil)
	_ api.WorkerMover     = (*replica)(nil)
	_ api.ShardAdmin      = (*replica)(nil)
	_ eventbus.LoadSink   = (*replica)(nil)
	_ eventbus.TenantSink = (*replica)(nil)
)

var _ api.CursorReporter = (*replica)(nil)

// CursorStatus is `/cluster/status?view=cursors` (api.CursorReporter): every
// worker rank's last applied event id and held blocks, as the full Status
// has them, and nothing that costs more than a map read (no Raft
// configuration read through the Raft loop, no snapshot listing, no JSON
// round trip): kvbench ingest polls it on every replica every few
// milliseconds. AppliedIndex is the control group's.
func (r *replica) CursorStatus() api.CursorStatus {
	leader, _ := r.node.Leader()
	st := api.CursorStatus{NodeID: r.node.ID(), State: r.node.State(), LeaderID: leader, AppliedIndex: r.fsm.AppliedIndex()}
	stale, cursors := r.staleRanks(), r.cursors()
	for _, w := range r.workers() {
		cw := api.CursorWorker{ID: w.ID}
		for _, key := range w.Keys() {
			rk := fsm.RankKey{Worker: w.ID, DPRank: rankOf(key)}
			cr := api.CursorRank{Rank: int(rk.DPRank), Blocks: r.heldBlocks(w.ID, key), LastEventID: cursors[rk]}
			if s, ok := stale[rk]; ok {
				cr.Stale = s.Reason
			}
			cw.Ranks = append(cw.Ranks, cr)
		}
		st.Workers = append(st.Workers, cw)
	}
	return st
}
