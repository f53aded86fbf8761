package replica

import (
	"fmt"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	dynamicfake "k8s.io/client-go/dynamic/fake"

	"github.com/kvrouter/kvrouter/cmd/kvrouter/internal/k8spool"
	"github.com/kvrouter/kvrouter/internal/poll"
)

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

func poolPod(name, ip string, ready bool) *corev1.Pod {
	st := corev1.ConditionFalse
	if ready {
		st = corev1.ConditionTrue
	}
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "serving", Labels: map[string]string{"app": "llama"}},
		Status: corev1.PodStatus{Phase: corev1.PodRunning, PodIP: ip,
			Conditions: []corev1.PodCondition{{Type: corev1.PodReady, Status: st}}},
	}
}

// TestReplicaInferencePool: three replicas watch one pool; the leader
// alone writes (the followers' watchers never run a pass), every replica
// sees the pool's Ready pods as workers, pod churn reaches all of them, and
// the next leader takes over after the leader stops.
func TestReplicaInferencePool(t *testing.T) {
	pool := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
		"metadata": map[string]any{"name": "llama", "namespace": "serving"},
		"spec": map[string]any{
			"selector":    map[string]any{"matchLabels": map[string]any{"app": "llama"}},
			"targetPorts": []any{map[string]any{"number": int64(8000)}},
		},
	}}
	objs := []runtime.Object{pool}
	for _, p := range []*corev1.Pod{poolPod("llama-0", "10.0.0.1", true), poolPod("llama-1", "10.0.0.2", true), poolPod("llama-2", "10.0.0.3", false)} {
		objs = append(objs, podObject(t, p))
	}
	dyn := dynamicfake.NewSimpleDynamicClientWithCustomListKinds(runtime.NewScheme(),
		map[schema.GroupVersionResource]string{k8spool.GVR: "InferencePoolList", k8spool.PodsGVR: "PodList"}, objs...)
	pods := dyn.Resource(k8spool.PodsGVR).Namespace("serving")
	tc := newTestClusterWith(t, 3, func(c *Config) {
		c.InferencePool = k8spool.Ref{Namespace: "serving", Name: "llama"}
		c.kube = &kubeClients{dynamic: dyn}
	})
	want := func(urls map[string]string) {
		t.Helper()
		poll.Until(t, 30*time.Second, 20*time.Millisecond, func() error {
			return tc.eachReplica(func(r *replica) error {
				ws := r.workers()
				if len(ws) != len(urls) {
					return fmt.Errorf("workers %v, want %v", ws, urls)
				}
				for _, w := range ws {
					if urls[w.ID] != w.Address || w.LeaseUntil == 0 || w.Model != model {
						return fmt.Errorf("worker %+v, want %v with a lease", w, urls)
					}
				}
				return nil
			})
		})
	}
	leader := tc.WaitLeader()
	want(map[string]string{"llama-0": "http://10.0.0.1:8000", "llama-1": "http://10.0.0.2:8000"})
	onlyLeaderWrites := func(leaderIdx int) {
		t.Helper()
		for _, m := range tc.Running() {
			if n, _ := tc.R(m.Index).pool.Status(); (m.Index == leaderIdx) != (n > 0) {
				t.Fatalf("member %d (leader %d) ran %d pool passes: only the leader writes", m.Index, leaderIdx, n)
			}
		}
	}
	onlyLeaderWrites(leader.Index)

	ctx := t.Context()
	if err := pods.Delete(ctx, "llama-1", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	want(map[string]string{"llama-0": "http://10.0.0.1:8000"})

	tc.Stop(leader.Index)
	next := tc.WaitLeader()
	if _, err := pods.Update(ctx, podObject(t, poolPod("llama-2", "10.0.0.3", true)), metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := pods.Update(ctx, podObject(t, poolPod("llama-0", "10.0.0.1", false)), metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	// The new leader registers the pod that turned ready. (llama-0 turning
	// unready races the takeover: a leader that saw it ready registered it
	// and deregisters it; one that never did leaves it to its lease.)
	poll.Until(t, 30*time.Second, 20*time.Millisecond, func() error {
		return tc.eachReplica(func(r *replica) error {
			if w, ok := r.worker("llama-2"); !ok || w.Address != "http://10.0.0.3:8000" {
				return fmt.Errorf("llama-2 not registered: %+v", w)
			}
			return nil
		})
	})
	onlyLeaderWrites(next.Index)
}
