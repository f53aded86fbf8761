package k8spool

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/dynamic"
	listersv1 "k8s.io/client-go/listers/core/v1"
	"k8s.io/client-go/tools/cache"
)

// Registry is where the pool's workers go: the replica's own registration
// path (the one POST /workers/register takes).
type Registry interface {
	// Register registers w, or renews its registration's lease.
	Register(ctx context.Context, w Worker) error
	// Deregister removes the worker; one no longer registered is no error.
	Deregister(ctx context.Context, id string) error
}

// Config is one pool watch.
type Config struct {
	Ref Ref
	// Dynamic reads the InferencePool and the pods, both unstructured: the
	// typed clientset and informer factories link every API group of
	// Kubernetes (about 40 MB more binary); pods are converted to
	// corev1.Pod as they enter the informer's store.
	Dynamic dynamic.Interface
	Log     *slog.Logger
	// RenewEvery is how often each worker's registration is renewed
	// (registrations carry a lease, so workers a lost leader registered
	// expire if the next leader no longer finds their pods).
	RenewEvery time.Duration
	// RetryEvery is the pause before a failed registration is tried again.
	RetryEvery time.Duration
}

// Watcher keeps informers on one InferencePool and on the pods of its
// namespace. Every replica runs one (so a new leader starts with a warm
// cache); only the leader runs Sync, which writes.
type Watcher struct {
	cfg     Config
	log     *slog.Logger
	pools   cache.SharedIndexInformer
	pods    listersv1.PodLister
	podsInf cache.SharedIndexInformer
	start   func(<-chan struct{})
	changed chan struct{} // one pending signal at most

	mu      sync.Mutex
	passes  int   // Sync passes finished (tests wait on it)
	lastErr error // the last pass's pool error, nil when the pool read well
}

// New builds the watcher; Start runs its informers.
func New(cfg Config) *Watcher {
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	if cfg.RenewEvery <= 0 {
		cfg.RenewEvery = 30 * time.Second
	}
	if cfg.RetryEvery <= 0 {
		cfg.RetryEvery = time.Second
	}
	w := &Watcher{cfg: cfg, log: cfg.Log.With("inference_pool", cfg.Ref.String()), changed: make(chan struct{}, 1)}
	// One pool object: the field selector keeps the watch to it.
	pools := cfg.Dynamic.Resource(GVR).Namespace(cfg.Ref.Namespace)
	w.pools = cache.NewSharedIndexInformer(&cache.ListWatch{
		ListWithContextFunc: func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
			o.FieldSelector = "metadata.name=" + cfg.Ref.Name
			return pools.List(ctx, o)
		},
		WatchFuncWithContext: func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
			o.FieldSelector = "metadata.name=" + cfg.Ref.Name
			return pools.Watch(ctx, o)
		},
	}, &unstructured.Unstructured{}, 0, cache.Indexers{})
	// Every pod of the namespace: the selector may change at any time,
	// and a changed selector must not wait for a new watch to list.
	pods := cfg.Dynamic.Resource(PodsGVR).Namespace(cfg.Ref.Namespace)
	w.podsInf = cache.NewSharedIndexInformer(&cache.ListWatch{
		ListWithContextFunc: func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) { return pods.List(ctx, o) },
		WatchFuncWithContext: func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
			return pods.Watch(ctx, o)
		},
	}, &unstructured.Unstructured{}, 0, cache.Indexers{cache.NamespaceIndex: cache.MetaNamespaceIndexFunc})
	// Before the handlers are added and the informer runs: no error.
	_ = w.podsInf.SetTransform(toPod)
	w.pods = listersv1.NewPodLister(w.podsInf.GetIndexer())
	h := cache.ResourceEventHandlerFuncs{
		AddFunc:    func(any) { w.notify() },
		UpdateFunc: func(any, any) { w.notify() },
		DeleteFunc: func(any) { w.notify() },
	}
	// Handlers are added before the informers start: no registration error.
	_, _ = w.pools.AddEventHandler(h)
	_, _ = w.podsInf.AddEventHandler(h)
	w.start = func(stop <-chan struct{}) { go w.pools.Run(stop); go w.podsInf.Run(stop) }
	return w
}

// PodsGVR is the core group's pods, read through the dynamic client.
var PodsGVR = schema.GroupVersionResource{Version: "v1", Resource: "pods"}

// toPod turns an unstructured pod from the dynamic client into a
// corev1.Pod as it enters the store (tombstones and typed pods pass).
func toPod(obj any) (any, error) {
	u, ok := obj.(*unstructured.Unstructured)
	if !ok {
		return obj, nil
	}
	var p corev1.Pod
	if err := runtime.DefaultUnstructuredConverter.FromUnstructured(u.UnstructuredContent(), &p); err != nil {
		return nil, fmt.Errorf("pod %s/%s: %w", u.GetNamespace(), u.GetName(), err)
	}
	return &p, nil
}

func (w *Watcher) notify() {
	select {
	case w.changed <- struct{}{}:
	default:
	}
}

// Start runs the informers until ctx ends and returns once both listed
// (or ctx ended first).
func (w *Watcher) Start(ctx context.Context) error {
	w.start(ctx.Done())
	if !cache.WaitForCacheSync(ctx.Done(), w.pools.HasSynced, w.podsInf.HasSynced) {
		return fmt.Errorf("inference pool %s: informers not synced: %w", w.cfg.Ref, ctx.Err())
	}
	return nil
}

// ErrPoolMissing: no such InferencePool (yet, or any more).
var ErrPoolMissing = errors.New("inference pool not found")

// Desired is the pool's workers as the informers see them now. A missing
// pool has none (ErrPoolMissing wrapped, with no workers); a pool that
// does not read is an error, and the caller changes nothing.
func (w *Watcher) Desired() ([]Worker, error) {
	obj, ok, err := w.pools.GetStore().GetByKey(w.cfg.Ref.String())
	if err != nil {
		return nil, fmt.Errorf("inference pool %s: %w", w.cfg.Ref, err)
	}
	if !ok {
		return nil, fmt.Errorf("%s: %w", w.cfg.Ref, ErrPoolMissing)
	}
	u, ok := obj.(*unstructured.Unstructured)
	if !ok {
		return nil, fmt.Errorf("inference pool %s: unexpected object %T", w.cfg.Ref, obj)
	}
	spec, err := ParseSpec(u)
	if err != nil {
		return nil, err
	}
	pods, err := w.pods.Pods(w.cfg.Ref.Namespace).List(labels.Everything())
	if err != nil {
		return nil, fmt.Errorf("inference pool %s: pods: %w", w.cfg.Ref, err)
	}
	ws, skipped := spec.Workers(pods)
	for _, e := range skipped {
		w.log.Warn("inference pool pod left out", "err", e)
	}
	return ws, nil
}

// Status is how many Sync passes finished and the last pass's pool error.
func (w *Watcher) Status() (passes int, lastErr error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.passes, w.lastErr
}

// owned is a worker this Sync registered, and when.
type owned struct {
	w       Worker
	renewed time.Time
}

// Sync keeps reg's workers equal to the pool's until ctx ends: it
// registers new pods' workers, deregisters those whose pods left the
// pool (unready, deleted, no longer selected, a port removed), and renews
// every worker's lease. It only removes workers it registered itself in
// this call: a worker registered by an earlier leader whose pod is gone
// expires with its lease. A pool that does not read changes nothing (its
// workers keep being renewed) and is logged until it reads again.
// Run it on one replica at a time (the leader).
func (w *Watcher) Sync(ctx context.Context, reg Registry) {
	// A partial list would deregister nothing it did not register, but
	// would register in bits: wait for both lists (Start runs them).
	if !cache.WaitForCacheSync(ctx.Done(), w.pools.HasSynced, w.podsInf.HasSynced) {
		return
	}
	mine := map[string]owned{}
	timer := time.NewTimer(0)
	defer timer.Stop()
	var logged string
	for {
		select {
		case <-ctx.Done():
			return
		case <-w.changed:
		case <-timer.C:
		}
		desired, err := w.Desired()
		if errors.Is(err, ErrPoolMissing) {
			desired, err = nil, nil
			if len(mine) > 0 {
				w.log.Warn("inference pool gone: deregistering its workers", "workers", len(mine))
			}
		}
		if err != nil && err.Error() != logged {
			w.log.Error("inference pool unreadable: its workers stay as they are", "err", err)
		}
		logged = ""
		if err != nil {
			logged = err.Error()
		}
		failed := w.pass(ctx, reg, mine, desired, err != nil)
		w.mu.Lock()
		w.passes++
		w.lastErr = err
		w.mu.Unlock()
		next := w.cfg.RenewEvery
		for _, o := range mine {
			next = min(next, max(time.Until(o.renewed.Add(w.cfg.RenewEvery)), 0))
		}
		if failed {
			next = min(next, w.cfg.RetryEvery)
		}
		if !timer.Stop() {
			select {
			case <-timer.C:
			default:
			}
		}
		timer.Reset(next)
	}
}

// pass brings reg to desired (or, when keep, only renews what is owned);
// it reports whether any write failed.
func (w *Watcher) pass(ctx context.Context, reg Registry, mine map[string]owned, desired []Worker, keep bool) (failed bool) {
	now := time.Now()
	if keep {
		for id, o := range mine {
			if now.Sub(o.renewed) >= w.cfg.RenewEvery {
				if err := reg.Register(ctx, o.w); err != nil {
					w.log.Warn("inference pool worker not renewed", "worker", id, "err", err)
					failed = true
					continue
				}
				mine[id] = owned{w: o.w, renewed: now}
			}
		}
		return failed
	}
	want := make(map[string]bool, len(desired))
	for _, d := range desired {
		want[d.ID] = true
		if o, ok := mine[d.ID]; ok && o.w == d && now.Sub(o.renewed) < w.cfg.RenewEvery {
			continue
		}
		if err := reg.Register(ctx, d); err != nil {
			w.log.Warn("inference pool worker not registered", "worker", d.ID, "url", d.URL, "err", err)
			failed = true
			continue
		}
		if _, ok := mine[d.ID]; !ok {
			w.log.Info("inference pool worker registered", "worker", d.ID, "url", d.URL)
		}
		mine[d.ID] = owned{w: d, renewed: now}
	}
	for id := range mine {
		if want[id] {
			continue
		}
		if err := reg.Deregister(ctx, id); err != nil {
			w.log.Warn("inference pool worker not deregistered", "worker", id, "err", err)
			failed = true
			continue
		}
		w.log.Info("inference pool worker deregistered", "worker", id)
		delete(mine, id)
	}
	return failed
}
