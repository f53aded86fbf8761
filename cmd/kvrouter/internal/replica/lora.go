package replica

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net/http"
	"slices"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/kvrouter/kvrouter/fsm"
	"github.com/kvrouter/kvrouter/router"
)

// loraDirectory learns which LoRA adapters each worker serves from the
// worker's own GET /v1/models: vLLM lists every loaded adapter there as a
// model whose "parent" is the base model (and so does SGLang). A request
// naming an adapter is then routed among the base model's workers that
// serve it, and hashed with Dynamo's LoRA seed for that adapter name, as
// the engines' KV events are (the bridge hashes adapter blocks with the
// adapter's name). Each replica polls for itself: this is a cache of what
// the workers say, not replicated state, and a stale entry costs at most a
// missed prefix or one 404 from a worker that unloaded the adapter.
type loraDirectory struct {
	client *http.Client
	// workerKey is the bearer token the proxy sends a worker (by id): a
	// worker started with --api-key answers /v1/models only with it.
	// useWorkerAccess sets it with client; nil: none.
	workerKey func(id string) string
	log       *slog.Logger
	every     time.Duration
	mu        sync.RWMutex
	// served: adapter → base model → workers (ranks) serving it. mu guards it.
	served map[string]map[string][]router.WorkerID
}

func newLoRADirectory(log *slog.Logger) *loraDirectory {
	return &loraDirectory{client: &http.Client{Timeout: 3 * time.Second}, log: log, every: 30 * time.Second,
		served: map[string]map[string][]router.WorkerID{}}
}

// useWorkerAccess makes discovery reach workers as the proxy does: over
// its transport, with each worker's API key (as the tokenizer self-check).
// Call it before run.
func (d *loraDirectory) useWorkerAccess(rt http.RoundTripper, key func(id string) string) {
	d.client = &http.Client{Transport: rt, Timeout: d.client.Timeout}
	d.workerKey = key
}

// Adapter returns the base model and the workers serving adapter; ok is
// false when no worker lists it (or it is listed under several base
// models, which cannot be hashed unambiguously; logged at refresh).
func (d *loraDirectory) Adapter(adapter string) (string, []router.WorkerID, bool) {
	d.mu.RLock()
	defer d.mu.RUnlock()
	bases := d.served[adapter]
	if len(bases) != 1 {
		return "", nil, false
	}
	for base, ws := range bases {
		return base, slices.Clone(ws), true
	}
	return "", nil, false
}

// snapshot is the directory for /cluster/status: adapter → base → workers.
func (d *loraDirectory) snapshot() map[string]map[string][]router.WorkerID {
	d.mu.RLock()
	defer d.mu.RUnlock()
	out := make(map[string]map[string][]router.WorkerID, len(d.served))
	for a, bases := range d.served {
		out[a] = map[string][]router.WorkerID{}
		for b, ws := range bases {
			out[a][b] = slices.Clone(ws)
		}
	}
	return out
}

func (d *loraDirectory) run(ctx context.Context, workers func() []fsm.WorkerRecord) {
	for {
		d.refresh(ctx, workers())
		t := time.NewTimer(d.every + rand.N(d.every/4+1))
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
	}
}

// refresh asks every worker for its models and rebuilds the directory.
func (d *loraDirectory) refresh(ctx context.Context, workers []fsm.WorkerRecord) {
	served := map[string]map[string][]router.WorkerID{}
	for _, w := range workers {
		adapters, err := d.adaptersOf(ctx, w)
		if err != nil {
			d.log.Debug("lora discovery: worker models unavailable", "worker", w.ID, "err", err)
			continue
		}
		for _, a := range adapters {
			if served[a] == nil {
				served[a] = map[string][]router.WorkerID{}
			}
			served[a][w.Model] = append(served[a][w.Model], w.Keys()...)
		}
	}
	for a, bases := range served {
		for b := range bases {
			sort.Slice(bases[b], func(i, j int) bool { return bases[b][i] < bases[b][j] })
		}
		if len(bases) > 1 {
			d.log.Warn("lora adapter served on top of several base models: not routed as an adapter", "adapter", a, "bases", keys(bases))
		}
	}
	d.mu.Lock()
	d.served = served
	d.mu.Unlock()
}

// adaptersOf lists the adapters a worker serves on top of its model: the
// /v1/models entries whose parent is the worker's model.
func (d *loraDirectory) adaptersOf(ctx context.Context, w fsm.WorkerRecord) ([]string, error) {
	var adapters []string
	key := ""
	if d.workerKey != nil {
		key = d.workerKey(w.ID)
	}
	err := httpGet(ctx, d.client, strings.TrimRight(w.Address, "/")+"/v1/models", key, 4<<20, func(r io.Reader) error {
		var err error
		adapters, err = parseAdapters(r, w.Model)
		return err
	})
	return adapters, err
}

// parseAdapters reads an OpenAI model list and returns the ids whose
// parent is base.
func parseAdapters(r io.Reader, base string) ([]string, error) {
	var list struct {
		Data []struct {
			ID     string  `json:"id"`
			Parent *string `json:"parent"`
		} `json:"data"`
	}
	if err := json.NewDecoder(r).Decode(&list); err != nil {
		return nil, fmt.Errorf("model list: %w", err)
	}
	var out []string
	for _, m := range list.Data {
		if m.Parent != nil && *m.Parent == base && m.ID != "" && m.ID != base {
			out = append(out, m.ID)
		}
	}
	return out, nil
}

func keys[V any](m map[string]V) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}
