package deploy

import (
	"os/exec"
	"strconv"
	"strings"
	"testing"
)

// drainPod is what the drain examples' checks read of a pod spec.
type drainPod struct {
	Grace      int `yaml:"terminationGracePeriodSeconds"`
	Containers []struct {
		Env []struct {
			Name  string `yaml:"name"`
			Value string `yaml:"value"`
		} `yaml:"env"`
		Command   []string `yaml:"command"`
		Lifecycle struct {
			PreStop struct {
				Exec struct {
					Command []string `yaml:"command"`
				} `yaml:"exec"`
			} `yaml:"preStop"`
		} `yaml:"lifecycle"`
	} `yaml:"containers"`
}

type drainObject struct {
	Kind string `yaml:"kind"`
	Spec struct {
		Template struct {
			Spec drainPod `yaml:"spec"`
		} `yaml:"template"`
		JobTemplate struct {
			Spec struct {
				Template struct {
					Spec drainPod `yaml:"spec"`
				} `yaml:"template"`
			} `yaml:"spec"`
		} `yaml:"jobTemplate"`
	} `yaml:"spec"`
}

// checkScript runs sh -n over a script (syntax only).
func checkScript(t *testing.T, what, script string) {
	t.Helper()
	cmd := exec.Command("sh", "-n")
	cmd.Stdin = strings.NewReader(script)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Errorf("%s: sh -n: %v %s", what, err, out)
	}
}

// TestDeployK8sDrainPreStop: the example's preStop hook drains the pod's
// worker, waits on the fleet plan, parses, and the grace period covers
// the drain deadline.
func TestDeployK8sDrainPreStop(t *testing.T) {
	objs := decodeAll[drainObject](t, "k8s/drain/worker-prestop.yaml")
	if len(objs) != 1 || objs[0].Kind != "StatefulSet" {
		t.Fatalf("want one StatefulSet, got %+v", objs)
	}
	pod := objs[0].Spec.Template.Spec
	if len(pod.Containers) != 1 {
		t.Fatal("want one container")
	}
	c := pod.Containers[0]
	hook := c.Lifecycle.PreStop.Exec.Command
	if len(hook) != 3 || hook[0] != "/bin/sh" {
		t.Fatalf("preStop %v", hook)
	}
	script := hook[2]
	for _, want := range []string{"/workers/drain", "/fleet/plan", `\"id\":\"$POD_NAME\"`, "deadline_secs"} {
		if !strings.Contains(script, want) {
			t.Errorf("preStop script lacks %s", want)
		}
	}
	checkScript(t, "preStop", script)
	deadline := -1
	for _, e := range c.Env {
		if e.Name == "DRAIN_DEADLINE_SECS" {
			deadline, _ = strconv.Atoi(e.Value)
		}
	}
	if deadline <= 0 || pod.Grace <= deadline+15 {
		t.Errorf("grace %d s does not cover the drain deadline %d s and the wait's slack", pod.Grace, deadline)
	}
}

// TestDeployK8sDeletionCostCronJob: the controller-less recipe reads the
// plan's pod-deletion-cost lines and pipes them to sh, with a Role that
// may only get and patch pods.
func TestDeployK8sDeletionCostCronJob(t *testing.T) {
	objs := decodeAll[drainObject](t, "k8s/drain/pod-deletion-cost.yaml")
	kinds := map[string]bool{}
	var script string
	for _, o := range objs {
		kinds[o.Kind] = true
		if o.Kind == "CronJob" {
			cs := o.Spec.JobTemplate.Spec.Template.Spec.Containers
			if len(cs) != 1 || len(cs[0].Command) != 3 {
				t.Fatalf("CronJob containers %+v", cs)
			}
			script = cs[0].Command[2]
		}
	}
	for _, k := range []string{"ServiceAccount", "Role", "RoleBinding", "CronJob"} {
		if !kinds[k] {
			t.Errorf("no %s", k)
		}
	}
	if !strings.Contains(script, "/fleet/plan?format=pod-deletion-cost") || !strings.Contains(script, "| sh") {
		t.Errorf("CronJob script %q", script)
	}
	checkScript(t, "CronJob", script)
	type role struct {
		Kind  string `yaml:"kind"`
		Rules []struct {
			Resources []string `yaml:"resources"`
			Verbs     []string `yaml:"verbs"`
		} `yaml:"rules"`
	}
	for _, r := range decodeAll[role](t, "k8s/drain/pod-deletion-cost.yaml") {
		if r.Kind != "Role" {
			continue
		}
		if len(r.Rules) != 1 || strings.Join(r.Rules[0].Resources, ",") != "pods" || strings.Join(r.Rules[0].Verbs, ",") != "get,patch" {
			t.Errorf("Role rules %+v: pods get and patch only", r.Rules)
		}
	}
}

// TestDeployK8sKEDAExample: the KEDA example queries the advice metric
// the replicas export, as an AverageValue of 1 (the advised count).
func TestDeployK8sKEDAExample(t *testing.T) {
	type scaled struct {
		Kind string `yaml:"kind"`
		Spec struct {
			Triggers []struct {
				Type       string            `yaml:"type"`
				MetricType string            `yaml:"metricType"`
				Metadata   map[string]string `yaml:"metadata"`
			} `yaml:"triggers"`
		} `yaml:"spec"`
	}
	objs := decodeAll[scaled](t, "k8s/autoscale/keda-scaledobject.yaml")
	if len(objs) != 1 || objs[0].Kind != "ScaledObject" || len(objs[0].Spec.Triggers) != 1 {
		t.Fatalf("want one ScaledObject with one trigger: %+v", objs)
	}
	tr := objs[0].Spec.Triggers[0]
	if tr.Type != "prometheus" || tr.MetricType != "AverageValue" || tr.Metadata["threshold"] != "1" ||
		!strings.Contains(tr.Metadata["query"], "kvrouter_fleet_desired_workers") {
		t.Errorf("trigger %+v", tr)
	}
}
