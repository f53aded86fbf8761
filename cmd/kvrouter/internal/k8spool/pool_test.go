package k8spool

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	dynamicfake "k8s.io/client-go/dynamic/fake"

	"github.com/kvrouter/kvrouter/internal/poll"
)

const ns = "serving"

// pool is an InferencePool as the API server would hand it over.
func pool(name string, matchLabels map[string]any, ports ...any) *unstructured.Unstructured {
	tps := make([]any, len(ports))
	for i, p := range ports {
		tps[i] = map[string]any{"number": p}
	}
	spec := map[string]any{
		"targetPorts":       tps,
		"endpointPickerRef": map[string]any{"name": "kvrouter", "port": map[string]any{"number": int64(9090)}},
	}
	if matchLabels != nil {
		spec["selector"] = map[string]any{"matchLabels": matchLabels}
	}
	return &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
		"metadata": map[string]any{"name": name, "namespace": ns},
		"spec":     spec,
	}}
}

func pod(name, ip string, lbl map[string]string, ready bool) *corev1.Pod {
	st := corev1.ConditionFalse
	if ready {
		st = corev1.ConditionTrue
	}
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns, Labels: lbl},
		Status: corev1.PodStatus{Phase: corev1.PodRunning, PodIP: ip,
			Conditions: []corev1.PodCondition{{Type: corev1.PodReady, Status: st}}},
	}
}

var (
	llama = map[string]string{"app": "llama"}
	qwen  = map[string]string{"app": "qwen"}
)

// fakeRegistry records what the pool registered, as the replica would.
type fakeRegistry struct {
	mu      sync.Mutex
	workers map[string]Worker
	writes  int
}

func (f *fakeRegistry) Register(_ context.Context, w Worker) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.workers[w.ID] = w
	f.writes++
	return nil
}

func (f *fakeRegistry) Deregister(_ context.Context, id string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	delete(f.workers, id)
	f.writes++
	return nil
}

// urls is id → URL of the registered workers, the shape tests compare.
func (f *fakeRegistry) urls() map[string]string {
	f.mu.Lock()
	defer f.mu.Unlock()
	out := map[string]string{}
	for id, w := range f.workers {
		out[id] = w.URL
	}
	return out
}

// harness is a watcher syncing into a fakeRegistry over fake clients.
type harness struct {
	t   *testing.T
	dyn *dynamicfake.FakeDynamicClient
	w   *Watcher
	reg *fakeRegistry
}

func newHarness(t *testing.T, objs []runtime.Object, pods ...*corev1.Pod) *harness {
	t.Helper()
	h := &harness{t: t, reg: &fakeRegistry{workers: map[string]Worker{}}}
	h.dyn = newFakeDynamic(t, objs, pods...)
	h.w = New(Config{Ref: Ref{ns, "llama"}, Dynamic: h.dyn, RenewEvery: time.Hour})
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	if err := h.w.Start(ctx); err != nil {
		t.Fatal(err)
	}
	go h.w.Sync(ctx, h.reg)
	return h
}

// waitWorkers polls until the registry holds exactly want.
func (h *harness) waitWorkers(want map[string]string) {
	h.t.Helper()
	poll.Until(h.t, 5*time.Second, 5*time.Millisecond, func() error {
		if got := h.reg.urls(); !maps.Equal(got, want) {
			return fmt.Errorf("registered %v, want %v", got, want)
		}
		return nil
	})
}

// waitPassError polls until a Sync pass after `after` passes ended with an
// error containing want ("" = none).
func (h *harness) waitPassError(after int, want string) {
	h.t.Helper()
	poll.Until(h.t, 5*time.Second, 5*time.Millisecond, func() error {
		n, e := h.w.Status()
		switch {
		case n <= after:
			return fmt.Errorf("%d passes, waiting for more than %d", n, after)
		case want == "" && e != nil, want != "" && (e == nil || !strings.Contains(e.Error(), want)):
			return fmt.Errorf("last pass error %v, want %q", e, want)
		}
		return nil
	})
}

func TestPoolSync(t *testing.T) {
	ctx := context.Background()
	pods := func() []*corev1.Pod {
		return []*corev1.Pod{
			pod("llama-0", "10.0.0.1", llama, true),
			pod("llama-1", "10.0.0.2", llama, true),
			pod("llama-2", "10.0.0.3", llama, false), // not ready
			pod("qwen-0", "10.0.1.1", qwen, true),
		}
	}
	both := map[string]string{"llama-0": "http://10.0.0.1:8000", "llama-1": "http://10.0.0.2:8000"}
	type step struct {
		name string
		do   func(h *harness)
		want map[string]string
	}
	cases := []struct {
		name  string
		pool  *unstructured.Unstructured
		steps []step
	}{
		{name: "selector pods become workers", pool: pool("llama", map[string]any{"app": "llama"}, int64(8000)),
			steps: []step{{name: "start", do: func(*harness) {}, want: both}}},
		{name: "pod unready then ready", pool: pool("llama", map[string]any{"app": "llama"}, int64(8000)),
			steps: []step{
				{name: "unready", do: func(h *harness) { h.updatePod(ctx, pod("llama-0", "10.0.0.1", llama, false)) },
					want: map[string]string{"llama-1": "http://10.0.0.2:8000"}},
				{name: "ready again", do: func(h *harness) { h.updatePod(ctx, pod("llama-0", "10.0.0.1", llama, true)) }, want: both},
				{name: "not-ready pod turns ready", do: func(h *harness) { h.updatePod(ctx, pod("llama-2", "10.0.0.3", llama, true)) },
					want: map[string]string{"llama-0": "http://10.0.0.1:8000", "llama-1": "http://10.0.0.2:8000", "llama-2": "http://10.0.0.3:8000"}},
			}},
		{name: "pod deleted, terminating, moved", pool: pool("llama", map[string]any{"app": "llama"}, int64(8000)),
			steps: []step{
				{name: "deleted", do: func(h *harness) { h.deletePod(ctx, "llama-1") }, want: map[string]string{"llama-0": "http://10.0.0.1:8000"}},
				{name: "recreated with a new IP", do: func(h *harness) { h.createPod(ctx, pod("llama-1", "10.0.0.9", llama, true)) },
					want: map[string]string{"llama-0": "http://10.0.0.1:8000", "llama-1": "http://10.0.0.9:8000"}},
				{name: "terminating", do: func(h *harness) {
					p := pod("llama-0", "10.0.0.1", llama, true)
					now := metav1.Now()
					p.DeletionTimestamp = &now
					h.updatePod(ctx, p)
				}, want: map[string]string{"llama-1": "http://10.0.0.9:8000"}},
				{name: "labels changed", do: func(h *harness) { h.updatePod(ctx, pod("llama-1", "10.0.0.9", qwen, true)) },
					want: map[string]string{}},
			}},
		{name: "selector and ports change", pool: pool("llama", map[string]any{"app": "llama"}, int64(8000)),
			steps: []step{
				{name: "selector", do: func(h *harness) { h.updatePool(ctx, pool("llama", map[string]any{"app": "qwen"}, int64(8000))) },
					want: map[string]string{"qwen-0": "http://10.0.1.1:8000"}},
				{name: "port", do: func(h *harness) { h.updatePool(ctx, pool("llama", map[string]any{"app": "qwen"}, int64(8001))) },
					want: map[string]string{"qwen-0": "http://10.0.1.1:8001"}},
				{name: "two ports", do: func(h *harness) {
					h.updatePool(ctx, pool("llama", map[string]any{"app": "qwen"}, int64(8000), int64(8001)))
				}, want: map[string]string{"qwen-0-8000": "http://10.0.1.1:8000", "qwen-0-8001": "http://10.0.1.1:8001"}},
				{name: "pool deleted", do: func(h *harness) { h.deletePool(ctx) }, want: map[string]string{}},
				{name: "pool created", do: func(h *harness) { h.createPool(ctx, pool("llama", map[string]any{"app": "llama"}, int64(8000))) }, want: both},
			}},
		{name: "no pool yet", pool: nil,
			steps: []step{
				{name: "nothing", do: func(*harness) {}, want: map[string]string{}},
				{name: "created", do: func(h *harness) { h.createPool(ctx, pool("llama", map[string]any{"app": "llama"}, int64(8000))) }, want: both},
			}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var objs []runtime.Object
			if tc.pool != nil {
				objs = append(objs, tc.pool)
			}
			h := newHarness(t, objs, pods()...)
			for _, s := range tc.steps {
				s.do(h)
				h.waitWorkers(s.want)
				if n, err := h.w.Status(); err != nil {
					t.Fatalf("%s: pass %d: %v", s.name, n, err)
				}
			}
		})
	}
}

// TestPoolSyncBadPool: a pool object that does not read is a clear error
// and changes nothing; fixed, the pool is followed again.
func TestPoolSyncBadPool(t *testing.T) {
	ctx := context.Background()
	start := map[string]string{"llama-0": "http://10.0.0.1:8000"}
	cases := []struct {
		name string
		bad  *unstructured.Unstructured
		want string
	}{
		{name: "no selector", bad: pool("llama", nil, int64(8000)), want: "spec.selector.matchLabels is empty"},
		{name: "empty selector", bad: pool("llama", map[string]any{}, int64(8000)), want: "spec.selector.matchLabels is empty"},
		{name: "bad label value", bad: pool("llama", map[string]any{"app": "not a label!"}, int64(8000)), want: "spec.selector.matchLabels"},
		{name: "no ports", bad: pool("llama", map[string]any{"app": "qwen"}), want: "spec.targetPorts has 0 ports"},
		{name: "port zero", bad: pool("llama", map[string]any{"app": "qwen"}, int64(0)), want: "spec.targetPorts[0].number 0 is not a port"},
		{name: "port too big", bad: pool("llama", map[string]any{"app": "qwen"}, int64(70000)), want: "is not a port"},
		{name: "port twice", bad: pool("llama", map[string]any{"app": "qwen"}, int64(8000), int64(8000)), want: "listed twice"},
		{name: "port a string", bad: pool("llama", map[string]any{"app": "qwen"}, "http"), want: "inference pool serving/llama"},
		{name: "nine ports", bad: pool("llama", map[string]any{"app": "qwen"}, int64(1), int64(2), int64(3), int64(4), int64(5), int64(6), int64(7), int64(8), int64(9)),
			want: "spec.targetPorts has 9 ports"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, []runtime.Object{pool("llama", map[string]any{"app": "llama"}, int64(8000))},
				pod("llama-0", "10.0.0.1", llama, true), pod("qwen-0", "10.0.1.1", qwen, true))
			h.waitWorkers(start)
			n, _ := h.w.Status()
			h.updatePool(ctx, tc.bad)
			h.waitPassError(n, tc.want)
			if got := h.reg.urls(); !maps.Equal(got, start) {
				t.Fatalf("bad pool changed the workers: %v, want %v", got, start)
			}
			// Pod churn while the pool is bad changes nothing either.
			n, _ = h.w.Status()
			h.deletePod(ctx, "llama-0")
			h.waitPassError(n, tc.want)
			if got := h.reg.urls(); !maps.Equal(got, start) {
				t.Fatalf("pod churn under a bad pool changed the workers: %v, want %v", got, start)
			}
			h.updatePool(ctx, pool("llama", map[string]any{"app": "qwen"}, int64(8000)))
			h.waitWorkers(map[string]string{"qwen-0": "http://10.0.1.1:8000"})
		})
	}
}

// TestPoolSyncNoWriteWithoutChange: pod updates that change no worker
// write nothing (three replicas' leaders would otherwise churn the log).
func TestPoolSyncNoWriteWithoutChange(t *testing.T) {
	ctx := context.Background()
	h := newHarness(t, []runtime.Object{pool("llama", map[string]any{"app": "llama"}, int64(8000))},
		pod("llama-0", "10.0.0.1", llama, true), pod("qwen-0", "10.0.1.1", qwen, true))
	h.waitWorkers(map[string]string{"llama-0": "http://10.0.0.1:8000"})
	n, _ := h.w.Status()
	p := pod("qwen-0", "10.0.1.1", qwen, false)
	h.updatePod(ctx, p)
	h.waitPassError(n, "")
	h.reg.mu.Lock()
	writes := h.reg.writes
	h.reg.mu.Unlock()
	if writes != 1 {
		t.Fatalf("%d registry writes, want 1 (the first registration only)", writes)
	}
}

func TestPoolParseRef(t *testing.T) {
	for _, tc := range []struct {
		in, err string
	}{
		{in: "serving/llama"},
		{in: "llama", err: "want namespace/name"},
		{in: "/llama", err: "want namespace/name"},
		{in: "serving/", err: "want namespace/name"},
		{in: "a/b/c", err: "want namespace/name"},
		{in: "Serving/llama", err: "namespace"},
		{in: "serving/Llama_1", err: "name"},
	} {
		r, err := ParseRef(tc.in)
		if tc.err == "" {
			if err != nil || r.String() != tc.in {
				t.Errorf("ParseRef(%q) = %v, %v", tc.in, r, err)
			}
			continue
		}
		if err == nil || !strings.Contains(err.Error(), tc.err) {
			t.Errorf("ParseRef(%q) error %v, want %q", tc.in, err, tc.err)
		}
	}
}

func TestPoolWorkersAnnotations(t *testing.T) {
	spec, err := ParseSpec(pool("llama", map[string]any{"app": "llama"}, int64(8000)))
	if err != nil {
		t.Fatal(err)
	}
	good := pod("llama-0", "fd00::1", llama, true)
	good.Annotations = map[string]string{AnnotationTotalKVBlocks: "4096", AnnotationMaxBatchedTokens: "8192"}
	bad := pod("llama-1", "10.0.0.2", llama, true)
	bad.Annotations = map[string]string{AnnotationTotalKVBlocks: "lots"}
	pending := pod("llama-2", "10.0.0.3", llama, true)
	pending.Status.Phase = corev1.PodPending
	ws, skipped := spec.Workers([]*corev1.Pod{bad, good, pending})
	want := []Worker{{ID: "llama-0", URL: "http://[fd00::1]:8000", TotalBlocks: 4096, MaxBatchedTokens: 8192}}
	if !slices.Equal(ws, want) {
		t.Fatalf("workers %v, want %v", ws, want)
	}
	if len(skipped) != 1 || !strings.Contains(skipped[0].Error(), "llama-1") || !strings.Contains(skipped[0].Error(), AnnotationTotalKVBlocks) {
		t.Fatalf("skipped %v, want llama-1's annotation named", skipped)
	}
}

// newFakeDynamic is client-go's fake dynamic client serving the pools
// and the pods (typed pods given are stored as the API server returns
// them through the dynamic client).
func newFakeDynamic(t testing.TB, pools []runtime.Object, pods ...*corev1.Pod) *dynamicfake.FakeDynamicClient {
	t.Helper()
	objs := slices.Clone(pools)
	for _, p := range pods {
		objs = append(objs, podObject(t, p))
	}
	return dynamicfake.NewSimpleDynamicClientWithCustomListKinds(runtime.NewScheme(),
		map[schema.GroupVersionResource]string{GVR: "InferencePoolList", PodsGVR: "PodList"}, objs...)
}

func podObject(t testing.TB, p *corev1.Pod) *unstructured.Unstructured {
	t.Helper()
	m, err := runtime.DefaultUnstructuredConverter.ToUnstructured(p)
	if err != nil {
		t.Fatal(err)
	}
	u := &unstructured.Unstructured{Object: m}
	u.SetAPIVersion("v1")
	u.SetKind("Pod")
	return u
}

func (h *harness) updatePod(ctx context.Context, p *corev1.Pod) {
	h.t.Helper()
	if _, err := h.dyn.Resource(PodsGVR).Namespace(ns).Update(ctx, podObject(h.t, p), metav1.UpdateOptions{}); err != nil {
		h.t.Fatal(err)
	}
}

func (h *harness) createPod(ctx context.Context, p *corev1.Pod) {
	h.t.Helper()
	if _, err := h.dyn.Resource(PodsGVR).Namespace(ns).Create(ctx, podObject(h.t, p), metav1.CreateOptions{}); err != nil {
		h.t.Fatal(err)
	}
}

func (h *harness) deletePod(ctx context.Context, name string) {
	h.t.Helper()
	if err := h.dyn.Resource(PodsGVR).Namespace(ns).Delete(ctx, name, metav1.DeleteOptions{}); err != nil {
		h.t.Fatal(err)
	}
}

func (h *harness) updatePool(ctx context.Context, u *unstructured.Unstructured) {
	h.t.Helper()
	if _, err := h.dyn.Resource(GVR).Namespace(ns).Update(ctx, u, metav1.UpdateOptions{}); err != nil {
		h.t.Fatal(fmt.Errorf("update pool: %w", err))
	}
}

func (h *harness) createPool(ctx context.Context, u *unstructured.Unstructured) {
	h.t.Helper()
	if _, err := h.dyn.Resource(GVR).Namespace(ns).Create(ctx, u, metav1.CreateOptions{}); err != nil {
		h.t.Fatal(err)
	}
}

func (h *harness) deletePool(ctx context.Context) {
	h.t.Helper()
	if err := h.dyn.Resource(GVR).Namespace(ns).Delete(ctx, "llama", metav1.DeleteOptions{}); err != nil {
		h.t.Fatal(err)
	}
}
