// Package k8spool turns a Gateway API Inference Extension InferencePool
// (inference.networking.k8s.io/v1, resource inferencepools) into kvrouter
// workers: every Ready pod its selector matches, at each of the pool's
// target ports, is one worker. It reads the pool through the dynamic client
// as an unstructured object, so kvrouter does not import the GAIE module
// (DESIGN.md says which fields it reads and why).
package k8spool

import (
	"fmt"
	"slices"
	"strconv"
	"strings"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/util/validation"
)

// GVR is the InferencePool resource of GAIE's v1 API (its CRD
// inference.networking.k8s.io_inferencepools.yaml at v1.3.0: the version
// served and stored).
var GVR = schema.GroupVersionResource{Group: "inference.networking.k8s.io", Version: "v1", Resource: "inferencepools"}

// Annotations a pod may carry to give its worker's capacity, as a
// registration carries it (absent: not given).
const (
	AnnotationTotalKVBlocks    = "kvrouter.io/total-kv-blocks"
	AnnotationMaxBatchedTokens = "kvrouter.io/max-num-batched-tokens"
)

// maxTargetPorts is the CRD's bound on spec.targetPorts.
const maxTargetPorts = 8

// Ref names one pool.
type Ref struct{ Namespace, Name string }

func (r Ref) String() string { return r.Namespace + "/" + r.Name }

// ParseRef reads "namespace/name".
func ParseRef(s string) (Ref, error) {
	ns, name, ok := strings.Cut(s, "/")
	if !ok || ns == "" || name == "" || strings.Contains(name, "/") {
		return Ref{}, fmt.Errorf("inference pool %q: want namespace/name", s)
	}
	if errs := validation.IsDNS1123Label(ns); len(errs) > 0 {
		return Ref{}, fmt.Errorf("inference pool %q: namespace: %s", s, strings.Join(errs, "; "))
	}
	if errs := validation.IsDNS1123Subdomain(name); len(errs) > 0 {
		return Ref{}, fmt.Errorf("inference pool %q: name: %s", s, strings.Join(errs, "; "))
	}
	return Ref{Namespace: ns, Name: name}, nil
}

// Worker is one pod port of the pool, as kvrouter registers it.
type Worker struct {
	ID  string // the pod's name; "<pod>-<port>" when the pool has several target ports
	URL string // http://<pod IP>:<port>
	// Capacity from the pod's annotations (0: not given).
	TotalBlocks, MaxBatchedTokens int
}

// Spec is what kvrouter reads of an InferencePool: the selector and the
// ports. The endpoint picker reference is the gateway's business.
type Spec struct {
	Selector labels.Selector
	Ports    []int32
}

// poolObject is the subset of GAIE's v1 InferencePool that is read, with
// the JSON names of its Go types (api/v1/inferencepool_types.go).
type poolObject struct {
	Spec struct {
		Selector struct {
			MatchLabels map[string]string `json:"matchLabels"`
		} `json:"selector"`
		TargetPorts []struct {
			Number int32 `json:"number"`
		} `json:"targetPorts"`
	} `json:"spec"`
}

// ParseSpec reads and checks a pool object. An error names the pool and
// the field; the caller keeps the workers it had.
func ParseSpec(u *unstructured.Unstructured) (Spec, error) {
	name := u.GetNamespace() + "/" + u.GetName()
	if gvk := u.GroupVersionKind(); gvk.Group != GVR.Group || gvk.Kind != "InferencePool" {
		return Spec{}, fmt.Errorf("inference pool %s: object is %s, not an InferencePool of %s", name, gvk, GVR.Group)
	}
	var p poolObject
	if err := runtime.DefaultUnstructuredConverter.FromUnstructured(u.UnstructuredContent(), &p); err != nil {
		return Spec{}, fmt.Errorf("inference pool %s: %w", name, err)
	}
	ml := p.Spec.Selector.MatchLabels
	if len(ml) == 0 {
		// An empty selector would select every pod of the namespace: the
		// CRD requires at least one label, so this is a broken object.
		return Spec{}, fmt.Errorf("inference pool %s: spec.selector.matchLabels is empty", name)
	}
	sel, err := labels.ValidatedSelectorFromSet(ml)
	if err != nil {
		return Spec{}, fmt.Errorf("inference pool %s: spec.selector.matchLabels: %w", name, err)
	}
	if n := len(p.Spec.TargetPorts); n == 0 || n > maxTargetPorts {
		return Spec{}, fmt.Errorf("inference pool %s: spec.targetPorts has %d ports, want 1 to %d", name, n, maxTargetPorts)
	}
	spec := Spec{Selector: sel}
	for i, tp := range p.Spec.TargetPorts {
		if tp.Number < 1 || tp.Number > 65535 {
			return Spec{}, fmt.Errorf("inference pool %s: spec.targetPorts[%d].number %d is not a port", name, i, tp.Number)
		}
		if slices.Contains(spec.Ports, tp.Number) {
			return Spec{}, fmt.Errorf("inference pool %s: spec.targetPorts[%d].number %d is listed twice", name, i, tp.Number)
		}
		spec.Ports = append(spec.Ports, tp.Number)
	}
	return spec, nil
}

// Workers maps the pods to the pool's workers: each Ready, running,
// not-terminating pod with an IP that the selector matches, at every
// target port, sorted by id. A pod with an unreadable capacity annotation
// is left out and reported in skipped.
func (s Spec) Workers(pods []*corev1.Pod) (ws []Worker, skipped []error) {
	for _, p := range pods {
		if !s.Selector.Matches(labels.Set(p.Labels)) || !serving(p) {
			continue
		}
		blocks, err := annotationInt(p, AnnotationTotalKVBlocks)
		if err != nil {
			skipped = append(skipped, err)
			continue
		}
		batched, err := annotationInt(p, AnnotationMaxBatchedTokens)
		if err != nil {
			skipped = append(skipped, err)
			continue
		}
		for _, port := range s.Ports {
			id := p.Name
			if len(s.Ports) > 1 {
				id = p.Name + "-" + strconv.Itoa(int(port))
			}
			ws = append(ws, Worker{ID: id, URL: "http://" + hostPort(p.Status.PodIP, port), TotalBlocks: blocks, MaxBatchedTokens: batched})
		}
	}
	slices.SortFunc(ws, func(a, b Worker) int { return strings.Compare(a.ID, b.ID) })
	return ws, skipped
}

// serving: the pod can take requests now. A terminating pod may still be
// Ready for its grace period; it gets nothing new.
func serving(p *corev1.Pod) bool {
	if p.DeletionTimestamp != nil || p.Status.Phase != corev1.PodRunning || p.Status.PodIP == "" {
		return false
	}
	for _, c := range p.Status.Conditions {
		if c.Type == corev1.PodReady {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}

func hostPort(ip string, port int32) string {
	if strings.Contains(ip, ":") {
		return "[" + ip + "]:" + strconv.Itoa(int(port))
	}
	return ip + ":" + strconv.Itoa(int(port))
}

func annotationInt(p *corev1.Pod, key string) (int, error) {
	v, ok := p.Annotations[key]
	if !ok {
		return 0, nil
	}
	n, err := strconv.Atoi(v)
	if err != nil || n < 0 {
		return 0, fmt.Errorf("pod %s/%s: annotation %s=%q is not a count: left out of the pool", p.Namespace, p.Name, key, v)
	}
	return n, nil
}
