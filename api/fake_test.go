package api

import (
	"context"
	"fmt"
	"slices"
	"sync"

	"github.com/kvrouter/kvrouter/router"
)

// fakeReplica is an in-memory Replica: one index and router per model, no Raft.
type fakeAdapter struct {
	base    string
	workers []router.WorkerID
}

type fakeReplica struct {
	adapters map[string]fakeAdapter  // LoRA adapter → base model and its workers
	ranks    map[router.WorkerID]int // DP rank of workers whose engine runs several
	mu       sync.Mutex
	index    *router.Index
	routers  map[string]*router.Router
	urls     map[router.WorkerID]string
	ready    bool
	drain    bool     // Draining (api.Drainer)
	events   []string // load notifications, for assertions
	booked   []router.Booking
}

func newFakeReplica(model string, cfg router.Config) *fakeReplica {
	ix := router.NewIndex(cfg.BlockSize)
	rt, err := router.New(cfg, ix, 1)
	if err != nil {
		panic(err)
	}
	return &fakeReplica{index: ix, routers: map[string]*router.Router{model: rt}, urls: map[router.WorkerID]string{}, ready: true}
}

func (f *fakeReplica) addWorker(model string, id router.WorkerID, url string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.urls[id] = url
	f.index.AddWorker(id)
	rt := f.routers[model]
	ws := rt.Workers()
	ws = append(ws, router.WorkerInfo{ID: id, TotalBlocks: 1000, MaxBatchedTokens: 8192})
	rt.SetWorkers(ws)
}

func (f *fakeReplica) NodeID() string { return "r1" }
func (f *fakeReplica) Models() []string {
	var ms []string
	for m := range f.routers {
		ms = append(ms, m)
	}
	slices.Sort(ms)
	return ms
}
func (f *fakeReplica) Router(m string) (*router.Router, bool) { rt, ok := f.routers[m]; return rt, ok }
func (f *fakeReplica) WorkerURL(id router.WorkerID) (string, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	u, ok := f.urls[id]
	return u, ok
}
func (f *fakeReplica) ReadBarrier(context.Context) error { return nil }
func (f *fakeReplica) DPRank(id router.WorkerID) (int, bool) {
	r, ok := f.ranks[id]
	return r, ok
}
func (f *fakeReplica) Adapter(name string) (string, []router.WorkerID, bool) {
	a, ok := f.adapters[name]
	return a.base, a.workers, ok
}
func (f *fakeReplica) Thresholds(m string) (router.Thresholds, bool) {
	rt, ok := f.routers[m]
	if !ok {
		return router.Thresholds{}, false
	}
	return rt.Config().Thresholds, true
}
func (f *fakeReplica) SetThresholds(_ context.Context, m string, u ThresholdUpdate) (router.Thresholds, error) {
	rt, ok := f.routers[m]
	if !ok {
		return router.Thresholds{}, ErrUnknownModel
	}
	cfg := rt.Config()
	cfg.Thresholds = u.Apply(cfg.Thresholds)
	if err := rt.SetConfig(cfg); err != nil {
		return router.Thresholds{}, fmt.Errorf("%w: %v", ErrInvalid, err)
	}
	return cfg.Thresholds, nil
}
func (f *fakeReplica) RegisterWorker(_ context.Context, w WorkerSpec) error {
	if _, ok := f.routers[w.Model]; !ok {
		return ErrUnknownModel
	}
	f.addWorker(w.Model, router.WorkerID(w.ID), w.URL)
	return nil
}
func (f *fakeReplica) DeregisterWorker(context.Context, string) error { return nil }
func (f *fakeReplica) Ready() (bool, string) {
	if f.ready {
		return true, ""
	}
	return false, "no leader"
}
func (f *fakeReplica) Draining() bool             { return f.drain }
func (f *fakeReplica) Status(bool) map[string]any { return map[string]any{"node_id": "r1"} }
func (f *fakeReplica) note(s string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.events = append(f.events, s)
}
func (f *fakeReplica) Audit(w router.WorkerID, predicted, reported, _ int) {
	f.note(fmt.Sprintf("audit %s %d/%d", w, predicted, reported))
}
func (f *fakeReplica) Booked(_ string, b router.Booking) {
	f.note("add " + b.ID)
	f.mu.Lock()
	defer f.mu.Unlock()
	f.booked = append(f.booked, b)
}
func (f *fakeReplica) PrefillDone(_, id string) { f.note("prefill " + id) }
func (f *fakeReplica) Freed(_, id string)       { f.note("free " + id) }
