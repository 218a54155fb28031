// The pod sandbox ("pause") image's one program: it holds a pod's namespaces open and does
// nothing else. It sleeps until SIGTERM or SIGINT and then exits 0, so the kubelet's stop of
// a pod sandbox ends it at once, not after its grace period. Built by
// scripts/start-kubernetes.sh into a local image, because no registry is reachable here.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGTERM, syscall.SIGINT)
	<-stop
}
